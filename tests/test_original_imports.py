"""Code written for the original Search-R1 (or veRL) imports from `verl` as it did there.

ORIGINAL_IMPORTS is every `from verl ... import ...` / `import verl...` line of the original
Search-R1's user-facing files (github.com/PeterGriffinJin/Search-R1 at a14dc3a:
verl/trainer/main_ppo.py, verl/utils/reward_score/*.py, search_r1/**, infer.py, scripts/**),
which forked trainers and custom reward functions copy. Each must resolve here.

Left out, and why:
* `from verl.workers.megatron_workers import ActorRolloutRefWorker, CriticWorker`,
  `from verl.single_controller.ray.megatron import NVMegatronRayWorkerGroup`,
  `from verl.workers.megatron_workers import RewardModelWorker`: Megatron-only (the original
  imports them only under `actor_rollout_ref.actor.strategy == 'megatron'`); this project
  trains with FSDP only.
* `from verl.workers.fsdp_workers import RewardModelWorker`: the original imports it only under
  `reward_model.enable=True` (a model-based reward), which this project rejects at config check
  (verl/trainer/config_check.py: the reward is rule-based), so a forked main_ppo.py never reaches it.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parents[1]

ORIGINAL_IMPORTS = [
    # scripts/data_process/{nq,nq_rag,nq_search,qa_search_test_merge,qa_search_train_merge}.py
    "from verl.utils.hdfs_io import copy, makedirs",
    # search_r1/llm_agent/generation.py
    "from verl import DataProto",
    "from verl.utils.tracking import Tracking",
    # verl/trainer/main_ppo.py
    "from verl.utils.reward_score import qa_em",
    "from verl.trainer.ppo.ray_trainer import RayPPOTrainer",
    "from verl.utils.fs import copy_local_path_from_hdfs",
    "from verl.utils import hf_tokenizer",
    "from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker",
    "from verl.single_controller.ray import RayWorkerGroup",
    "from verl.trainer.ppo.ray_trainer import ResourcePoolManager, Role",
]


@pytest.mark.parametrize("line", ORIGINAL_IMPORTS)
def test_an_import_line_of_the_original_resolves(line: str) -> None:
    namespace: dict[str, object] = {}
    exec(line, namespace)  # noqa: S102 - the line is one of the literal imports above
    names = [name.strip() for name in line.split(" import ", 1)[1].split(",")]
    for name in names:
        assert namespace.get(name) is not None, f"{line!r} bound no {name!r}"


def test_import_verl_stays_light() -> None:
    """`from verl import DataProto` loads torch only when DataProto is asked for, so the light
    modules (batch keys, the file helpers) do not pull torch into the retrieval server or scripts."""
    code = ("import sys, verl, verl.utils, verl.utils.batch_keys, verl.utils.fs\n"
            "assert 'torch' not in sys.modules, 'importing verl loaded torch'\n"
            "from verl import DataProto\n"
            "from verl.protocol import DataProto as P\n"
            "assert DataProto is P\n"
            "try:\n    verl.NoSuchThing\nexcept AttributeError as e:\n    assert 'NoSuchThing' in str(e)\n"
            "else:\n    raise AssertionError('verl.NoSuchThing resolved')\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ----------------------------------------------------------------- verl.protocol helpers
def _batch(rows: int = 6) -> object:
    from verl import DataProto

    return DataProto.from_dict(
        {"input_ids": torch.arange(rows * 3).reshape(rows, 3), "score": torch.arange(rows, dtype=torch.float32)},
        {"uid": [f"u{i}" for i in range(rows)]}, meta_info={"temperature": 1.0})


def test_fold_then_unfold_batch_dim_gives_back_the_rows() -> None:
    from verl.protocol import fold_batch_dim, unfold_batch_dim

    data = _batch(6)
    folded = fold_batch_dim(data, 2)
    assert len(folded) == 2
    assert folded.batch["input_ids"].shape == (2, 3, 3)
    assert folded.non_tensor_batch["uid"].shape == (2, 3)
    assert folded.non_tensor_batch["uid"][1].tolist() == ["u3", "u4", "u5"]   # consecutive rows grouped
    back = unfold_batch_dim(folded, batch_dims=2)
    assert len(back) == 6
    assert torch.equal(back.batch["input_ids"], data.batch["input_ids"])
    assert back.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()
    assert back.meta_info == {"temperature": 1.0}


def test_fold_batch_dim_names_sizes_that_do_not_divide() -> None:
    from verl.protocol import DataProtoError, fold_batch_dim

    with pytest.raises(DataProtoError, match="new_batch_size 4 must divide the batch size 6"):
        fold_batch_dim(_batch(6), 4)


def test_union_tensor_dict_adds_keys_and_names_a_conflict() -> None:
    from verl.protocol import BatchSizeMismatchError, KeyConflictError, union_tensor_dict

    a = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    merged = union_tensor_dict(a, TensorDict({"x": torch.zeros(2), "y": torch.ones(2)}, batch_size=[2]))
    assert merged is a and sorted(a.keys()) == ["x", "y"]
    with pytest.raises(KeyConflictError, match="'x'"):
        union_tensor_dict(a, TensorDict({"x": torch.ones(2)}, batch_size=[2]))
    with pytest.raises(BatchSizeMismatchError, match=r"\[2\] and \[3\]"):
        union_tensor_dict(a, TensorDict({"z": torch.ones(3)}, batch_size=[3]))


def test_union_numpy_dict_adds_keys_and_names_a_conflict() -> None:
    from verl.protocol import KeyConflictError, union_numpy_dict

    a = {"uid": np.array(["a", "b"], dtype=object)}
    merged = union_numpy_dict(a, {"uid": np.array(["a", "b"], dtype=object), "n": np.array([1, 2])})
    assert merged is a and sorted(a) == ["n", "uid"]
    with pytest.raises(KeyConflictError, match="'uid'"):
        union_numpy_dict(a, {"uid": np.array(["a", "c"], dtype=object)})


def test_list_of_dict_to_dict_of_list() -> None:
    from verl.protocol import list_of_dict_to_dict_of_list

    assert list_of_dict_to_dict_of_list([]) == {}
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}
    with pytest.raises(KeyError, match="dict 1"):
        list_of_dict_to_dict_of_list([{"a": 1}, {"a": 2, "c": 3}])


def test_print_size_reports_tensor_and_numpy_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    data = _batch(6)
    data.print_size(prefix="rollout")
    tensor_gb = (6 * 3 * 8 + 6 * 4) / 1024**3
    numpy_gb = data.non_tensor_batch["uid"].nbytes / 1024**3
    assert capsys.readouterr().out.strip() == (
        f"rollout, Size of tensordict: {tensor_gb} GB, size of non_tensor_batch: {numpy_gb} GB")


# ----------------------------------------------------------------- verl.utils.hf_tokenizer, fs, hdfs_io
def test_hf_tokenizer_pads_with_eos_when_the_tokenizer_has_no_pad(tmp_path: Path) -> None:
    from verl.utils import hf_tokenizer
    from verl.utils.tiny_model import train_bpe_tokenizer

    tok = train_bpe_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = hf_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token and loaded.pad_token_id == loaded.eos_token_id
    assert any("pad_token" in str(w.message) for w in caught)
    assert hf_tokenizer(str(tmp_path), correct_pad_token=False).pad_token is None


def test_copy_local_path_from_hdfs_passes_local_paths_and_names_hdfs_ones(tmp_path: Path) -> None:
    from verl.utils.fs import copy_local_path_from_hdfs

    assert copy_local_path_from_hdfs(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=r"'hdfs://nn/models/qwen' is an HDFS path.*hdfs dfs -get"):
        copy_local_path_from_hdfs("hdfs://nn/models/qwen")


def test_hdfs_io_copy_and_makedirs_work_on_local_paths(tmp_path: Path) -> None:
    """What the original's data scripts do with --hdfs_dir: makedirs(dir), copy(src=local_dir, dst=dir)."""
    from verl.utils.hdfs_io import copy, makedirs

    src = tmp_path / "local"
    src.mkdir()
    (src / "train.parquet").write_bytes(b"x")
    makedirs(str(tmp_path / "a" / "b"), exist_ok=True)
    assert (tmp_path / "a" / "b").is_dir()
    copy(src=str(src), dst=str(tmp_path / "a" / "b" / "data"))
    assert (tmp_path / "a" / "b" / "data" / "train.parquet").read_bytes() == b"x"
    with pytest.raises(ValueError, match="hdfs://nn/data.*HDFS is not supported"):
        copy(src=str(src), dst="hdfs://nn/data")
