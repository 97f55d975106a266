"""Merge the evaluation splits (test, else dev) of several FlashRAG sources into test.parquet.

    python scripts/data_process/qa_search_test_merge.py --local_dir data/nq_hotpotqa_train \
        --data_sources nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle

Each row keeps its source as data_source, so validation reports EM per source.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the original's command line): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.data_process.common import add_common_args, build_merged, parse_sources, write_parquet  # noqa: E402

DEFAULT_SOURCES = "nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle"
EVAL_SPLITS = ("test", "dev")


def merge_test(sources: list[str], local_dir: str | Path, input_dir: str | Path | None = None) -> Path:
    rows = build_merged(sources, EVAL_SPLITS, "test", input_dir if input_dir is not None else local_dir)
    return write_parquet(rows, Path(local_dir) / "test.parquet")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_local_dir="./data/nq_hotpotqa_train")
    parser.add_argument("--data_sources", default=DEFAULT_SOURCES)
    args = parser.parse_args(argv)
    path = merge_test(parse_sources(args.data_sources), args.local_dir, args.input_dir)
    print(f"test: {path}")
    return path


if __name__ == "__main__":
    main()
