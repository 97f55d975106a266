"""Merge the evaluation splits (test, else dev) of several FlashRAG sources into test.parquet.

    python scripts/data_process/qa_search_test_merge.py --local_dir data/nq_hotpotqa_train \
        --data_sources nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle

Each row keeps its source as data_source, so validation reports EM per source.

With --format tool the rows are veRL's native tool-calling rows (data_source searchR1_<source>).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the original's command line): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.data_process.common import merge_cli  # noqa: E402

DEFAULT_SOURCES = "nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle"
EVAL_SPLITS = ("test", "dev")


def main(argv: list[str] | None = None) -> Path:
    return merge_cli(argv, __doc__, DEFAULT_SOURCES, EVAL_SPLITS, "test")


if __name__ == "__main__":
    main()
