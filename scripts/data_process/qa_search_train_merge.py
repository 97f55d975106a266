"""Merge the train splits of several FlashRAG sources into one train.parquet.

    python scripts/data_process/qa_search_train_merge.py --local_dir data/nq_hotpotqa_train \
        --data_sources nq,hotpotqa

Indices (extra_info.index) are unique across the merged sources.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the original's command line): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.data_process.common import add_common_args, build_merged, parse_sources, write_parquet  # noqa: E402

DEFAULT_SOURCES = "nq,hotpotqa"


def merge_train(sources: list[str], local_dir: str | Path, input_dir: str | Path | None = None) -> Path:
    rows = build_merged(sources, ("train",), "train", input_dir if input_dir is not None else local_dir)
    return write_parquet(rows, Path(local_dir) / "train.parquet")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_local_dir="./data/nq_hotpotqa_train")
    parser.add_argument("--data_sources", default=DEFAULT_SOURCES)
    args = parser.parse_args(argv)
    path = merge_train(parse_sources(args.data_sources), args.local_dir, args.input_dir)
    print(f"train: {path}")
    return path


if __name__ == "__main__":
    main()
