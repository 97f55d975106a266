"""Tiny data files for preflight tests (Search-R1's parquet layout)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def write_data(folder: Path, source: str = "nq") -> list[str]:
    """train.parquet / test.parquet in `folder`, 4 rows each of `source`; returns the overrides that
    point data.* and trainer.default_local_dir (<folder>/ckpt) at them."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"Question {i}: who wrote Hamlet?"}],
             "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
             "extra_info": {"split": "train", "index": i}} for i in range(4)]
    for name in ("train", "test"):
        pd.DataFrame(rows).to_parquet(folder / f"{name}.parquet")
    return [f"data.train_files={folder / 'train.parquet'}", f"data.val_files={folder / 'test.parquet'}",
            f"trainer.default_local_dir={folder / 'ckpt'}"]
