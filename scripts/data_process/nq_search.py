"""NQ in the FlashRAG layout -> data/nq_search/{train,test}.parquet (Search-R1 prompt).

    python scripts/data_process/nq_search.py --local_dir data/nq_search
    python scripts/data_process/nq_search.py --local_dir out --input_dir my_flashrag   # offline
    python scripts/data_process/nq_search.py --local_dir data/nq_search_tool --format tool  # veRL's tool rows

As in the original, `train` becomes train.parquet and `test` test.parquet. Local JSONL
({input_dir}/nq/{split}.jsonl) is used when present, else the hub (online only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the original's command line): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.data_process.common import (  # noqa: E402
    add_common_args,
    load_source_split,
    local_dir_for,
    records_to_rows,
    write_parquet,
)


def process_source(source: str, local_dir: str | Path, input_dir: str | Path | None = None,
                   data_source: str | None = None, splits: tuple[str, ...] = ("train", "test"),
                   fmt: str = "tags", template_type: str = "base") -> dict[str, Path]:
    """Write {local_dir}/{split}.parquet (rows in format `fmt`) for each split of one source; returns the paths."""
    source_dir = local_dir_for(source, input_dir if input_dir is not None else local_dir)
    written = {}
    for split in splits:
        records = load_source_split(source, split, source_dir)
        rows = records_to_rows(records, data_source or source, split, fmt=fmt, template_type=template_type)
        written[split] = write_parquet(rows, Path(local_dir) / f"{split}.parquet")
    return written


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_local_dir="./data/nq_search")
    args = parser.parse_args(argv)
    written = process_source("nq", args.local_dir, args.input_dir, fmt=args.fmt, template_type=args.template_type)
    for split, path in written.items():
        print(f"{split}: {path}")
    return written


if __name__ == "__main__":
    main()
