"""Merge the train splits of several FlashRAG sources into one train.parquet.

    python scripts/data_process/qa_search_train_merge.py --local_dir data/nq_hotpotqa_train \
        --data_sources nq,hotpotqa

Indices (extra_info.index) are unique across the merged sources.

With --format tool the rows are veRL's native tool-calling rows (data_source searchR1_<source>).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the original's command line): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.data_process.common import merge_cli  # noqa: E402

DEFAULT_SOURCES = "nq,hotpotqa"


def main(argv: list[str] | None = None) -> Path:
    return merge_cli(argv, __doc__, DEFAULT_SOURCES, ("train",), "train")


if __name__ == "__main__":
    main()
