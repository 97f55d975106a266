"""DataProto: construction checks, row operations, combining, and serialization round trips."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    BatchSizeMismatchError,
    DataProto,
    DataProtoError,
    DataProtoItem,
    KeyConflictError,
    collate_fn,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from verl.utils import batch_keys as K


def make_batch(n: int = 6, meta: dict | None = None) -> DataProto:
    return DataProto.from_dict(
        tensors={
            K.INPUT_IDS: torch.arange(n * 3).view(n, 3),
            K.ATTENTION_MASK: torch.ones(n, 3, dtype=torch.long),
        },
        non_tensors={K.UID: [f"u{i}" for i in range(n)], K.REWARD_MODEL: [{"target": [str(i)]} for i in range(n)]},
        meta_info=meta if meta is not None else {K.META_TEMPERATURE: 1.0},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert a.meta_info == b.meta_info


# ------------------------------------------------------------------ construction
def test_from_dict_builds_batch_and_object_arrays():
    data = make_batch(4)
    assert len(data) == 4
    assert data.batch.batch_size == torch.Size([4])
    assert data.non_tensor_batch[K.UID].dtype == object
    # Lists of lists must stay 1-D (one object per row), not become a 2-D array.
    nested = DataProto.from_dict(non_tensors={"targets": [["a", "b"], ["c", "d"]]})
    assert nested.non_tensor_batch["targets"].shape == (2,)
    assert nested.non_tensor_batch["targets"][1] == ["c", "d"]


def test_inconsistent_tensor_lengths_name_the_key():
    with pytest.raises(BatchSizeMismatchError, match=r"tensors\['responses'\] has 2 rows but tensors\['input_ids'\] has 3"):
        DataProto.from_dict({K.INPUT_IDS: torch.zeros(3, 2), K.RESPONSES: torch.zeros(2, 2)})


def test_inconsistent_non_tensor_length_names_key_and_both_lengths():
    with pytest.raises(BatchSizeMismatchError, match=r"non_tensor_batch\['uid'\] has 2 rows but batch has 3"):
        DataProto.from_dict({K.INPUT_IDS: torch.zeros(3, 2)}, {K.UID: ["a", "b"]})


def test_non_tensor_that_is_not_an_array_is_rejected():
    batch = TensorDict({K.INPUT_IDS: torch.zeros(2, 2)}, batch_size=[2])
    with pytest.raises(TypeError, match=r"non_tensor_batch\['uid'\] must be a numpy array"):
        DataProto(batch=batch, non_tensor_batch={K.UID: ["a", "b"]})


def test_from_single_dict_splits_tensors_and_arrays():
    data = DataProto.from_single_dict(
        {K.INPUT_IDS: torch.zeros(2, 3), K.DATA_SOURCE: np.array(["nq", "hotpotqa"], dtype=object)}, meta_info={"a": 1}
    )
    assert list(data.batch.keys()) == [K.INPUT_IDS]
    assert list(data.non_tensor_batch) == [K.DATA_SOURCE]
    assert data.meta_info == {"a": 1}
    with pytest.raises(TypeError, match="data\\['bad'\\]"):
        DataProto.from_single_dict({"bad": [1, 2]})


# ------------------------------------------------------------------ indexing and selection
def test_int_index_returns_row_item():
    item = make_batch(4)[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch[K.INPUT_IDS].tolist() == [6, 7, 8]
    assert item.non_tensor_batch[K.UID] == "u2"
    assert item.meta_info == {K.META_TEMPERATURE: 1.0}
    with pytest.raises(IndexError, match="row 9 out of range for a batch of 4"):
        make_batch(4)[9]


@pytest.mark.parametrize(
    "index",
    [slice(1, 3), [1, 2], torch.tensor([1, 2]), np.array([1, 2]), torch.tensor([False, True, True, False])],
    ids=["slice", "list", "tensor", "numpy", "bool_mask"],
)
def test_slice_list_tensor_and_mask_select_rows(index):
    sub = make_batch(4)[index]
    assert isinstance(sub, DataProto)
    assert sub.non_tensor_batch[K.UID].tolist() == ["u1", "u2"]
    assert sub.batch[K.INPUT_IDS][:, 0].tolist() == [3, 6]


def test_select_keeps_only_named_keys_and_unknown_key_is_named():
    data = make_batch(3)
    sub = data.select(batch_keys=[K.INPUT_IDS], non_tensor_batch_keys=[K.UID], meta_info_keys=[])
    assert list(sub.batch.keys()) == [K.INPUT_IDS]
    assert list(sub.non_tensor_batch) == [K.UID]
    assert sub.meta_info == {}
    with pytest.raises(KeyError, match="values"):
        data.select(batch_keys=[K.VALUES])


def test_select_deepcopy_is_independent_of_source():
    data = make_batch(3)
    copied = data.select(deepcopy=True)
    copied.batch[K.INPUT_IDS][0, 0] = 100
    copied.non_tensor_batch[K.REWARD_MODEL][0]["target"].append("x")
    assert data.batch[K.INPUT_IDS][0, 0] == 0
    assert data.non_tensor_batch[K.REWARD_MODEL][0] == {"target": ["0"]}


def test_pop_removes_keys_from_source():
    data = make_batch(3)
    popped = data.pop(batch_keys=[K.INPUT_IDS], non_tensor_batch_keys=[K.UID], meta_info_keys=[K.META_TEMPERATURE])
    assert list(popped.batch.keys()) == [K.INPUT_IDS] and list(popped.non_tensor_batch) == [K.UID]
    assert popped.meta_info == {K.META_TEMPERATURE: 1.0}
    assert list(data.batch.keys()) == [K.ATTENTION_MASK]
    assert list(data.non_tensor_batch) == [K.REWARD_MODEL] and data.meta_info == {}
    assert len(popped) == len(data) == 3


def test_rename_moves_key():
    data = make_batch(2).rename(K.ATTENTION_MASK, K.INFO_MASK)
    assert K.INFO_MASK in data.batch.keys() and K.ATTENTION_MASK not in data.batch.keys()
    with pytest.raises(KeyError, match="nope"):
        data.rename("nope", "x")


# ------------------------------------------------------------------ combining
def test_union_merges_and_conflict_names_the_key():
    data = make_batch(3)
    extra = DataProto.from_dict({K.VALUES: torch.ones(3, 3), K.INPUT_IDS: data.batch[K.INPUT_IDS].clone()})
    merged = data.union(extra)
    assert merged is data and K.VALUES in data.batch.keys()
    clash = DataProto.from_dict({K.INPUT_IDS: torch.zeros(3, 3, dtype=torch.long)})
    with pytest.raises(KeyConflictError, match="input_ids"):
        data.union(clash)
    with pytest.raises(KeyConflictError, match="uid"):
        data.union(DataProto.from_dict(non_tensors={K.UID: ["x", "y", "z"]}))


def test_union_meta_info_conflict_names_the_key():
    data = make_batch(2, meta={K.META_TEMPERATURE: 1.0})
    data.union(DataProto.from_dict({K.INPUT_IDS: data.batch[K.INPUT_IDS]}, meta_info={K.META_DO_SAMPLE: False}))
    assert data.meta_info == {K.META_TEMPERATURE: 1.0, K.META_DO_SAMPLE: False}
    with pytest.raises(ValueError, match="temperature"):
        data.union(DataProto.from_dict(meta_info={K.META_TEMPERATURE: 0.5}, non_tensors={K.UID: ["u0", "u1"]}))


def test_concat_stacks_rows_and_checks_keys():
    a, b = make_batch(2), make_batch(3)
    joined = DataProto.concat([a, b])
    assert len(joined) == 5
    assert joined.non_tensor_batch[K.UID].tolist() == ["u0", "u1", "u0", "u1", "u2"]
    with pytest.raises(KeyError, match="item 1"):
        DataProto.concat([a, a.select(batch_keys=[K.INPUT_IDS])])


def test_concat_of_nothing_or_empty_parts_is_sensible():
    assert len(DataProto.concat([])) == 0
    data = make_batch(3)
    assert len(DataProto.concat([data[0:0], data, data[3:]])) == 3


def test_chunk_then_concat_round_trips():
    data = make_batch(6)
    parts = data.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert_same(DataProto.concat(parts), data)
    with pytest.raises(DataProtoError, match="cannot chunk a batch of 6 rows into 4"):
        data.chunk(4)


def test_split_leaves_a_short_tail():
    assert [len(p) for p in make_batch(5).split(2)] == [2, 2, 1]


def test_make_iterator_covers_every_row_each_epoch():
    data = make_batch(6)
    batches = list(data.make_iterator(mini_batch_size=2, epochs=2, seed=0))
    assert len(batches) == 6 and all(len(b) == 2 for b in batches)
    for epoch in (batches[:3], batches[3:]):
        assert sorted(u for b in epoch for u in b.non_tensor_batch[K.UID]) == [f"u{i}" for i in range(6)]
    with pytest.raises(DataProtoError, match="must divide the batch size 6"):
        next(data.make_iterator(mini_batch_size=4))


def test_repeat_interleaved_and_tiled():
    data = make_batch(2)
    inter = data.repeat(3, interleave=True)
    tiled = data.repeat(3, interleave=False)
    assert inter.non_tensor_batch[K.UID].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert tiled.non_tensor_batch[K.UID].tolist() == ["u0", "u1", "u0", "u1", "u0", "u1"]
    assert inter.batch[K.INPUT_IDS][:, 0].tolist() == [0, 0, 0, 3, 3, 3]
    assert tiled.batch[K.INPUT_IDS][:, 0].tolist() == [0, 3, 0, 3, 0, 3]


def test_reorder_permutes_in_place():
    data = make_batch(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert data.non_tensor_batch[K.UID].tolist() == ["u2", "u0", "u1"]
    assert data.batch[K.INPUT_IDS][:, 0].tolist() == [6, 0, 3]


def test_pad_then_unpad_round_trips_and_pads_with_leading_rows():
    data = make_batch(5)
    padded, pad_size = pad_dataproto_to_divisor(data, 4)
    assert pad_size == 3 and len(padded) == 8
    assert padded.non_tensor_batch[K.UID].tolist()[5:] == ["u0", "u1", "u2"]
    assert_same(unpad_dataproto(padded, pad_size), data)
    same, zero = pad_dataproto_to_divisor(data, 5)
    assert zero == 0 and same is data
    # More padding than rows: the rows are cycled.
    tiny, pad = pad_dataproto_to_divisor(make_batch(1), 3)
    assert pad == 2 and tiny.non_tensor_batch[K.UID].tolist() == ["u0"] * 3


def test_collate_fn_stacks_tensors_and_wraps_the_rest():
    rows = [{K.INPUT_IDS: torch.tensor([i, i]), K.DATA_SOURCE: "nq", K.EXTRA_INFO: {"index": i}} for i in range(3)]
    data = collate_fn(rows)
    assert data.batch[K.INPUT_IDS].shape == (3, 2)
    assert data.non_tensor_batch[K.EXTRA_INFO][2] == {"index": 2}
    with pytest.raises(KeyError, match="row 1"):
        collate_fn([rows[0], {K.INPUT_IDS: torch.tensor([0, 0])}])


def test_to_device_keeps_values():
    data = make_batch(2).to("cpu")
    assert data.batch.device == torch.device("cpu")


# ------------------------------------------------------------------ serialization
def test_pickle_round_trip():
    data = make_batch(4)
    restored = pickle.loads(pickle.dumps(data))
    assert_same(restored, data)
    state = data.__getstate__()
    assert isinstance(state["batch"], bytes)


def test_pickled_chunk_does_not_carry_the_whole_batch():
    data = DataProto.from_dict({K.VALUES: torch.zeros(1000, 100)})
    whole, half = len(pickle.dumps(data)), len(pickle.dumps(data.chunk(2)[1]))
    assert half < 0.6 * whole
    assert torch.equal(pickle.loads(pickle.dumps(data.chunk(2)[1])).batch[K.VALUES], torch.zeros(500, 100))


def test_save_and_load_from_disk_round_trip(tmp_path):
    data = make_batch(3)
    path = str(tmp_path / "batch.pkl")
    data.save_to_disk(path)
    assert_same(DataProto.load_from_disk(path), data)
