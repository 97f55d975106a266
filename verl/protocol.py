"""DataProto: the batch that travels between the driver and the worker groups.

A DataProto holds B rows: `batch` is a TensorDict with batch_size [B], `non_tensor_batch`
maps names to numpy object arrays of length B, and `meta_info` carries settings that apply
to the whole batch (temperature, eos id, metrics). Key names live in verl/utils/batch_keys.py.
It checks itself when built, so a wrong length fails at the producer, naming the key.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoFuture",
    "DataProtoError",
    "BatchSizeMismatchError",
    "KeyConflictError",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "collate_fn",
    "union_tensor_dict",
    "union_numpy_dict",
    "fold_batch_dim",
    "unfold_batch_dim",
    "list_of_dict_to_dict_of_list",
]


class DataProtoError(ValueError):
    """Base class for malformed or incompatible batches."""


class BatchSizeMismatchError(DataProtoError):
    """A key's first dimension differs from the batch size."""


class KeyConflictError(DataProtoError):
    """Two batches being merged hold different values under the same key."""


def _to_object_array(values: Sequence[Any]) -> np.ndarray:
    # np.array(list_of_lists, dtype=object) would build a 2-D array; fill a 1-D one instead.
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        return all(_same_value(x, y) for x, y in zip(a.ravel().tolist(), b.ravel().tolist(), strict=True))
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        # Elements like nested arrays make == ambiguous; their serialized forms are comparable.
        return pickle.dumps(a) == pickle.dumps(b)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    # torch.save writes a view's whole storage; a chunk sent to one worker must not carry the full batch.
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def _as_index(idxs: Any, length: int) -> torch.Tensor:
    """Normalise a list / numpy array / tensor of ints or bools into a long index tensor."""
    index = torch.as_tensor(np.asarray(idxs)) if not isinstance(idxs, torch.Tensor) else idxs
    if index.dtype == torch.bool:
        if index.numel() != length:
            raise IndexError(f"boolean mask has {index.numel()} entries but the batch has {length} rows")
        return index.nonzero(as_tuple=True)[0]
    if index.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if index.dtype.is_floating_point or index.dtype.is_complex:
        raise IndexError(f"row indices must be integers or booleans, got dtype {index.dtype}")
    return index.long().reshape(-1)


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add tensor_dict2's keys to tensor_dict1 (in place, returned); a key in both must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise BatchSizeMismatchError(
            f"union of TensorDicts with batch sizes {list(tensor_dict1.batch_size)} and "
            f"{list(tensor_dict2.batch_size)}"
        )
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2[key]
        elif not _same_value(tensor_dict1[key], tensor_dict2[key]):
            raise KeyConflictError(f"union: batch[{key!r}] differs between the two batches")
    return tensor_dict1


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add dict2's arrays to dict1 (in place, returned); a key in both must hold equal arrays."""
    for key, value in dict2.items():
        if key in dict1 and not _same_value(dict1[key], value):
            raise KeyConflictError(f"union: non_tensor_batch[{key!r}] differs between the two batches")
        dict1[key] = value
    return dict1


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """[{a: 1, b: 2}, {a: 3, b: 4}] -> {a: [1, 3], b: [2, 4]}; every dict must have the first one's keys."""
    if not list_of_dict:
        return {}
    keys = list(list_of_dict[0])
    output: dict[str, list[Any]] = {key: [] for key in keys}
    for i, row in enumerate(list_of_dict):
        if sorted(row) != sorted(keys):
            raise KeyError(f"list_of_dict_to_dict_of_list: dict {i} has keys {sorted(row)} but dict 0 has {sorted(keys)}")
        for key, value in row.items():
            output[key].append(value)
    return output


@dataclass
class DataProtoItem:
    """One row of a DataProto (what `data[i]` returns)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """B rows of tensors (`batch`) and numpy object arrays (`non_tensor_batch`), plus `meta_info`."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ----------------------------------------------------------------- building
    def check_consistency(self) -> None:
        """Raise if any key's first dimension disagrees with the batch size, naming the key."""
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        expected, source = None, None
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise TypeError(f"batch must be a TensorDict, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"batch must have exactly one batch dimension, got batch_size={list(self.batch.batch_size)}"
                )
            expected, source = int(self.batch.batch_size[0]), "batch"
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}"
                )
            if value.ndim == 0:
                raise BatchSizeMismatchError(f"non_tensor_batch[{key!r}] is a 0-d array; it needs one row per sample")
            if expected is None:
                expected, source = len(value), f"non_tensor_batch[{key!r}]"
            elif len(value) != expected:
                raise BatchSizeMismatchError(
                    f"non_tensor_batch[{key!r}] has {len(value)} rows but {source} has {expected}"
                )

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from tensors (first dim = B) and non-tensors (arrays or lists of length B)."""
        tensors = tensors or {}
        batch = None
        if tensors:
            first_key = next(iter(tensors))
            size = None
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
                if value.dim() == 0:
                    raise BatchSizeMismatchError(f"tensors[{key!r}] is a scalar; it needs one row per sample")
                if size is None:
                    size = value.shape[0]
                elif value.shape[0] != size:
                    raise BatchSizeMismatchError(
                        f"tensors[{key!r}] has {value.shape[0]} rows but tensors[{first_key!r}] has {size}"
                    )
            batch = TensorDict(dict(tensors), batch_size=[size])
        arrays = {}
        for key, value in (non_tensors or {}).items():
            arrays[key] = value if isinstance(value, np.ndarray) else _to_object_array(list(value))
        return cls(batch=batch, non_tensor_batch=arrays, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Split one dict into tensors and numpy arrays by value type."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise TypeError(f"data[{key!r}] must be a torch.Tensor or np.ndarray, got {type(value).__name__}")
        return cls.from_dict(tensors, non_tensors, meta_info)

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        if isinstance(item, (int, np.integer)):
            row = int(item)
            if not -len(self) <= row < len(self):
                raise IndexError(f"row {row} out of range for a batch of {len(self)}")
            return DataProtoItem(
                batch=self.batch[row] if self.batch is not None else None,
                non_tensor_batch={key: value[row] for key, value in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto cannot be indexed by {type(item).__name__}")

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows picked by an int list / tensor / numpy array or a boolean mask, as a new DataProto."""
        index = _as_index(idxs, len(self))
        np_index = index.numpy()
        batch = self.batch[index] if self.batch is not None else None
        non_tensors = {key: value[np_index] for key, value in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows start:end:step as a new DataProto (tensors are views)."""
        sl = slice(start, end, step)
        batch = self.batch[sl] if self.batch is not None else None
        non_tensors = {key: value[sl] for key, value in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    @staticmethod
    def _check_keys(wanted: Sequence[str] | None, present: Any, where: str) -> list[str] | None:
        if wanted is None:
            return None
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        missing = [key for key in wanted if key not in present]
        if missing:
            raise KeyError(f"{where} has no key(s) {missing}; present: {sorted(present)}")
        return wanted

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all of that kind)."""
        present = list(self.batch.keys()) if self.batch is not None else []
        batch_keys = self._check_keys(batch_keys, present, "batch")
        nt_keys = self._check_keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch")
        meta_keys = self._check_keys(meta_info_keys, self.meta_info, "meta_info")
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non_tensors = {k: self.non_tensor_batch[k] for k in (nt_keys if nt_keys is not None else self.non_tensor_batch)}
        meta = {k: self.meta_info[k] for k in (meta_keys if meta_keys is not None else self.meta_info)}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensors, meta = copy.deepcopy(non_tensors), copy.deepcopy(meta)
        elif batch is self.batch and batch is not None:
            # A shallow copy so that adding keys to the result never edits self.
            batch = batch.select(*batch.keys())
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto of the same length."""
        present = list(self.batch.keys()) if self.batch is not None else []
        batch_keys = self._check_keys(batch_keys, present, "batch") or []
        nt_keys = self._check_keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch") or []
        meta_keys = self._check_keys(meta_info_keys, self.meta_info, "meta_info") or []
        batch = None
        if self.batch is not None:
            # Keep an (possibly key-less) TensorDict so the popped part still knows its length.
            batch = TensorDict({k: self.batch.pop(k) for k in batch_keys}, batch_size=self.batch.batch_size)
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in nt_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch (or non-tensor) keys in place; returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename got {len(old)} old keys but {len(new)} new keys")
        for old_key, new_key in zip(old, new, strict=True):
            if self.batch is not None and old_key in self.batch.keys():
                self.batch.rename_key_(old_key, new_key)
            elif old_key in self.non_tensor_batch:
                self.non_tensor_batch[new_key] = self.non_tensor_batch.pop(old_key)
            else:
                raise KeyError(f"rename: no key {old_key!r} in batch or non_tensor_batch")
        return self

    # ----------------------------------------------------------------- combining
    def union(self, other: DataProto) -> DataProto:
        """Merge other's keys into self (in place, returns self); equal keys must hold equal values."""
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch):
            raise BatchSizeMismatchError(f"union of batches with {len(self)} and {len(other)} rows")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.select(*other.batch.keys())
            else:
                union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _same_value(self.meta_info[key], value):
                raise KeyConflictError(
                    f"union: meta_info[{key!r}] differs: {self.meta_info[key]!r} vs {value!r}"
                )
            self.meta_info[key] = value
        self.check_consistency()
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Stack batches row-wise; meta_info comes from the first. An empty list gives an empty batch."""
        parts = list(data)
        if not parts:
            return DataProto()
        first = parts[0]
        first_keys = sorted(first.batch.keys()) if first.batch is not None else None
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise TypeError(f"concat: item {i} is a {type(part).__name__}, not a DataProto")
            keys = sorted(part.batch.keys()) if part.batch is not None else None
            if keys != first_keys:
                raise KeyError(f"concat: item {i} has batch keys {keys} but item 0 has {first_keys}")
            if sorted(part.non_tensor_batch) != sorted(first.non_tensor_batch):
                raise KeyError(
                    f"concat: item {i} has non-tensor keys {sorted(part.non_tensor_batch)} "
                    f"but item 0 has {sorted(first.non_tensor_batch)}"
                )
        batch = torch.cat([p.batch for p in parts], dim=0) if first.batch is not None else None
        non_tensors = {
            key: np.concatenate([p.non_tensor_batch[key] for p in parts], axis=0) for key in first.non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(first.meta_info))

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal parts; the length must divide (pad with pad_dataproto_to_divisor)."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if len(self) % chunks != 0:
            raise DataProtoError(
                f"cannot chunk a batch of {len(self)} rows into {chunks} equal parts; "
                f"pad it first with pad_dataproto_to_divisor(data, {chunks})"
            )
        size = len(self) // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of `split_size` rows; the last one may be shorter."""
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    def make_iterator(self, mini_batch_size: int, epochs: int = 1, seed: int | None = None) -> Iterator[DataProto]:
        """Mini-batches of `mini_batch_size` rows for `epochs` passes; shuffled per epoch when seed is set."""
        if mini_batch_size < 1 or len(self) % mini_batch_size != 0:
            raise DataProtoError(f"mini_batch_size {mini_batch_size} must divide the batch size {len(self)}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator) if generator is not None else torch.arange(len(self))
            for start in range(0, len(self), mini_batch_size):
                yield self.select_idxs(order[start : start + mini_batch_size])

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row repeated: interleave gives a,a,b,b; otherwise a,b,a,b."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        batch = None
        if self.batch is not None:
            if interleave:
                batch = self.batch.repeat_interleave(repeat_times, dim=0)
            else:
                batch = torch.cat([self.batch] * repeat_times, dim=0)
        non_tensors = {}
        for key, value in self.non_tensor_batch.items():
            if interleave:
                non_tensors[key] = np.repeat(value, repeat_times, axis=0)
            else:
                non_tensors[key] = np.tile(value, (repeat_times,) + (1,) * (value.ndim - 1))
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place (as veRL does, e.g. for sequence-length balancing)."""
        index = _as_index(indices, len(self))
        if index.numel() != len(self):
            raise IndexError(f"reorder needs {len(self)} indices, got {index.numel()}")
        if self.batch is not None:
            self.batch = self.batch[index]
        np_index = index.numpy()
        self.non_tensor_batch = {key: value[np_index] for key, value in self.non_tensor_batch.items()}

    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to `device` in place; returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def print_size(self, prefix: str = "") -> None:
        """Print the bytes the tensors and the numpy arrays hold, in GB (veRL's memory probe)."""
        tensor_bytes = sum(t.element_size() * t.numel() for t in self.batch.values()) if self.batch is not None else 0
        numpy_bytes = sum(array.nbytes for array in self.non_tensor_batch.values())
        message = (f"Size of tensordict: {tensor_bytes / 1024**3} GB, "
                   f"size of non_tensor_batch: {numpy_bytes / 1024**3} GB")
        print(f"{prefix}, {message}" if prefix else message)

    # ----------------------------------------------------------------- serialization
    def __getstate__(self) -> dict[str, Any]:
        # One torch.save blob for all tensors: Ray ships it as a single buffer instead of
        # pickling the TensorDict's Python object graph.
        blob = None
        if self.batch is not None:
            buffer = io.BytesIO()
            tensors = {key: _compact(self.batch[key]) for key in self.batch.keys()}
            torch.save({"tensors": tensors, "batch_size": list(self.batch.batch_size)}, buffer)
            blob = buffer.getvalue()
        return {"batch": blob, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = None
        if state["batch"] is not None:
            loaded = torch.load(io.BytesIO(state["batch"]), weights_only=False, map_location="cpu")
            batch = TensorDict(loaded["tensors"], batch_size=loaded["batch_size"])
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def save_to_disk(self, path: str) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(path: str) -> DataProto:
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad by repeating leading rows until len(data) divides by size_divisor; returns (padded, pad_size)."""
    if size_divisor < 1:
        raise ValueError(f"size_divisor must be >= 1, got {size_divisor}")
    remainder = len(data) % size_divisor
    if remainder == 0:
        return data, 0
    if len(data) == 0:
        raise DataProtoError("cannot pad an empty batch: there are no rows to repeat")
    pad_size = size_divisor - remainder
    padding = data.select_idxs([i % len(data) for i in range(pad_size)])
    return DataProto.concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last pad_size rows added by pad_dataproto_to_divisor."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} is outside [0, {len(data)}]")
    return data.slice(0, len(data) - pad_size) if pad_size else data


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Rows [B, ...] regrouped as [new_batch_size, B // new_batch_size, ...]: a batch of new_batch_size
    rows, each holding B // new_batch_size consecutive old rows. `unfold_batch_dim` undoes it."""
    if new_batch_size < 1 or len(data) % new_batch_size != 0:
        raise DataProtoError(f"fold_batch_dim: new_batch_size {new_batch_size} must divide the batch size {len(data)}")
    batch = None
    if data.batch is not None:
        tensors = {key: t.reshape(new_batch_size, -1, *t.shape[1:]) for key, t in data.batch.items()}
        batch = TensorDict(tensors, batch_size=[new_batch_size])
    non_tensors = {key: value.reshape(new_batch_size, -1, *value.shape[1:])
                   for key, value in data.non_tensor_batch.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Flatten the first `batch_dims` dimensions of every tensor and array into one batch dimension."""
    if batch_dims < 1:
        raise ValueError(f"batch_dims must be >= 1, got {batch_dims}")
    values: dict[str, Any] = {**(dict(data.batch.items()) if data.batch is not None else {}), **data.non_tensor_batch}
    leading = {key: tuple(value.shape[:batch_dims]) for key, value in values.items()}
    for key, value in values.items():
        if value.ndim < batch_dims or leading[key] != next(iter(leading.values())):
            raise BatchSizeMismatchError(
                f"unfold_batch_dim: {key!r} has shape {tuple(value.shape)}; every key needs the same first "
                f"{batch_dims} dimensions ({next(iter(leading.values()))})"
            )
    batch = None
    if data.batch is not None:
        tensors = {key: t.reshape(-1, *t.shape[batch_dims:]) for key, t in data.batch.items()}
        rows = math.prod(next(iter(leading.values()))) if leading else 0
        batch = TensorDict(tensors, batch_size=[rows])
    non_tensors = {key: value.reshape(-1, *value.shape[batch_dims:]) for key, value in data.non_tensor_batch.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(data.meta_info))


def collate_fn(data_list: list[dict[str, Any]]) -> DataProto:
    """DataLoader collate: tensors are stacked, everything else becomes a numpy object array."""
    if not data_list:
        raise ValueError("collate_fn got an empty list of rows")
    keys = list(data_list[0])
    for i, row in enumerate(data_list):
        if sorted(row) != sorted(keys):
            raise KeyError(f"collate_fn: row {i} has keys {sorted(row)} but row 0 has {sorted(keys)}")
    tensors, non_tensors = {}, {}
    for key in keys:
        values = [row[key] for row in data_list]
        if isinstance(values[0], torch.Tensor):
            tensors[key] = torch.stack(values)
        else:
            non_tensors[key] = _to_object_array(values)
    return DataProto.from_dict(tensors, non_tensors)


@dataclass
class DataProtoFuture:
    """A DataProto still being computed by workers: `get()` waits, collects and (optionally) dispatches.

    `collect_fn` turns the list of resolved results into one value; `dispatch_fn`, when set,
    picks this consumer's share of it (e.g. one chunk).
    """

    collect_fn: Callable[[list[Any]], Any]
    futures: list[Any]
    dispatch_fn: Callable[[Any], Any] | None = None

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future of the row-wise concatenation of the given object refs."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        return [
            DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures, dispatch_fn=_ChunkPicker(chunks, i))
            for i in range(chunks)
        ]

    def get(self) -> Any:
        import ray

        output = self.collect_fn(ray.get(self.futures))
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output


@dataclass(frozen=True)
class _ChunkPicker:
    """Picklable 'take chunk i of n' (a lambda would not survive the trip to a worker)."""

    chunks: int
    index: int

    def __call__(self, data: DataProto) -> DataProto:
        return data.chunk(self.chunks)[self.index]
