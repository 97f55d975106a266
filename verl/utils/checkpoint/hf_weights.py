"""Read the weights of a Hugging Face folder one tensor at a time, in the dtype they are stored in.

The counterpart of `hf_export.py`: it reads what that module writes (numbered safetensors shards
plus `model.safetensors.index.json`), what `save_pretrained` writes (`model.safetensors`, or
shards and an index), and the older `pytorch_model.bin` (or its shards and
`pytorch_model.bin.index.json`). Nothing is converted: a bf16 checkpoint yields bf16 tensors.

Memory: a safetensors tensor is a private, read-only-in-practice mapping of its file's pages
(clean page cache, which the kernel may drop), opened for that one tensor and unmapped when the
tensor is released; a `.bin` shard is opened with `torch.load(mmap=True)`, and only the last
opened shard stays mapped. So a reader that is handed one name at a time holds one stored tensor
at a time.

    weights = HFWeights.open("/models/Qwen2.5-7B")
    weights.manifest()["model.embed_tokens.weight"]   # TensorMeta(dtype=torch.bfloat16, shape=(152064, 3584))
    tensor = weights.read("model.embed_tokens.weight")
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# safetensors' dtype names (safe_open(...).get_slice(name).get_dtype()).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorMeta:
    """What every rank must know of a stored tensor to receive it: dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def local_model_folder(path: str) -> str:
    """`path` itself when it is a folder, else a hub id resolved through the local HF cache
    (downloading the weights and json files unless HF_HUB_OFFLINE is set)."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.bin"])
    except Exception as err:
        raise FileNotFoundError(f"model path {path!r} is neither a local folder nor a hub id whose weights are in "
                                f"the Hugging Face cache ({type(err).__name__}: {err})") from err


class HFWeights:
    """Names, dtypes and shapes of a folder's stored tensors, and `read(name)` of one of them."""

    def __init__(self, folder: str, file_of: dict[str, str], kind: str) -> None:
        self.folder = folder
        self.kind = kind                  # "safetensors" or "bin"
        self._file_of = file_of           # tensor name -> file name within `folder`
        self._manifest: dict[str, TensorMeta] | None = None
        self._bin_file: str | None = None
        self._bin_state: dict[str, torch.Tensor] | None = None

    @classmethod
    def open(cls, path: str) -> HFWeights:
        """The weights in folder (or hub id) `path`: safetensors first, then `.bin` files."""
        folder = local_model_folder(path)
        for index_name, single_name, kind in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
                                              (BIN_INDEX, BIN_SINGLE, "bin")):
            index_path = os.path.join(folder, index_name)
            if os.path.isfile(index_path):
                with open(index_path) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise ValueError(f"{index_path}: no 'weight_map' naming the file of each tensor")
                return cls(folder, dict(weight_map), kind)
            if os.path.isfile(os.path.join(folder, single_name)):
                return cls(folder, cls._names_in(folder, single_name, kind), kind)
        raise FileNotFoundError(f"{folder}: no model weights ({SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, {BIN_INDEX} "
                                f"or {BIN_SINGLE})")

    @staticmethod
    def _names_in(folder: str, file_name: str, kind: str) -> dict[str, str]:
        path = os.path.join(folder, file_name)
        if kind == "safetensors":
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                return dict.fromkeys(f.keys(), file_name)
        return dict.fromkeys(_load_bin(path), file_name)

    def manifest(self) -> dict[str, TensorMeta]:
        """Every stored tensor's dtype and shape, from the file headers (no tensor data is read)."""
        if self._manifest is None:
            manifest: dict[str, TensorMeta] = {}
            for file_name in sorted(set(self._file_of.values())):
                path = os.path.join(self.folder, file_name)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{path}: named by the checkpoint index of {self.folder} but missing")
                manifest.update(self._file_manifest(path))
            missing = sorted(set(self._file_of) - set(manifest))
            if missing:
                raise ValueError(f"{self.folder}: the index names tensors its files do not hold: {missing[:5]}")
            self._manifest = {name: manifest[name] for name in self._file_of}
        return self._manifest

    def _file_manifest(self, path: str) -> dict[str, TensorMeta]:
        if self.kind == "safetensors":
            from safetensors import safe_open

            out = {}
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensor_slice = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{path}: tensor {name!r} has dtype {tensor_slice.get_dtype()}, "
                                         f"which this loader does not know")
                    out[name] = TensorMeta(dtype, tuple(int(s) for s in tensor_slice.get_shape()))
            return out
        return {name: TensorMeta(t.dtype, tuple(t.shape)) for name, t in self._bin(path).items()}

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` on the CPU in its stored dtype, backed by the file's mapped pages."""
        file_name = self._file_of.get(name)
        if file_name is None:
            raise KeyError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        path = os.path.join(self.folder, file_name)
        if self.kind == "safetensors":
            from safetensors import safe_open

            # Opened for this tensor alone: the file's mapping ends with the tensor, so pages read
            # for earlier tensors are not kept mapped (they would count in this process's RSS).
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        return self._bin(path)[name]

    def _bin(self, path: str) -> dict[str, torch.Tensor]:
        if self._bin_file != path:
            self._bin_state = None   # the previous shard's mapping goes before the next one opens
            self._bin_state = _load_bin(path)
            self._bin_file = path
        assert self._bin_state is not None
        return self._bin_state


def _load_bin(path: str) -> dict[str, Any]:
    """A `.bin` state dict, memory-mapped (tensors are read from the file when used)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:   # e.g. the legacy (pre-zip) format, which cannot be mapped
        raise ValueError(f"{path}: cannot be memory-mapped ({err}); re-save the model with "
                         "save_pretrained(safe_serialization=True)") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state
