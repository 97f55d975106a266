"""LoRA on the FSDP2 actor with Hugging Face PEFT (`actor_rollout_ref.model.lora_rank > 0`, veRL's keys).

    spec = LoraSpec.from_model_config(cfg.actor_rollout_ref.model)   # None when lora_rank == 0
    module = build_causal_lm(...)                                     # on the meta device
    spec.inject(module, frozen_dtype=torch.bfloat16)                  # before FSDP2 wraps it

- `inject` puts PEFT's LoRA layers into the Hugging Face model in place
  (`peft.inject_adapter_in_model`: the model keeps its class, so gradient checkpointing, FSDP2's
  per-layer wrapping and `base_model_prefix` work as without LoRA). Every parameter but the
  adapter's is frozen and cast to `frozen_dtype` (bf16 on GPUs: no fp32 master copy of frozen
  weights); the adapter stays fp32 and is all the optimizer sees (it takes requires_grad params).
- The sharded load (verl/utils/sharded_init.py) reads the base weights under their checkpoint names
  (`checkpoint_name`: PEFT's `.base_layer` dropped) and initialises the adapter as PEFT does
  (`init_adapter`: lora_A Kaiming-uniform, lora_B zero, so the adapted model starts as the base),
  or from `lora_adapter_path`'s adapter_model.safetensors.
- `lora_adapter_path`: the adapter is built from its own adapter_config.json as
  `PeftModel.from_pretrained` builds it (`SAVED_FIELDS_BUILT`: rsLoRA's alpha / sqrt(r), DoRA's
  magnitude vector, per-module `rank_pattern` / `alpha_pattern`, the layer selection); a field that
  would make it compute otherwise here is refused by name (`saved_adapter_errors`).
- LoRA on the input embedding or the output head (embed_tokens, lm_head) is refused at injection:
  the sharded load, the fused log-prob head and the tied export handle linear adapters only.
- `adapter_disabled(module)`: the base model (the reference policy's log-probs, no second model);
  `FrozenAdapter`: a host copy of the starting adapter, swapped in for the reference instead
  (`actor_rollout_ref.ref.lora_reference=start_adapter`).
- `merged_state(module)`: full (gathered) weights with W + scaling * B @ A (DoRA: each output row then
  rescaled to its magnitude) under checkpoint names: what a vLLM engine without LoRA loads.
- `save_adapter(module, folder)`: adapter_model.safetensors + adapter_config.json, PEFT's format
  (`PeftModel.from_pretrained(base, folder)` reads it; so does infer.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."   # PeftModel.save_pretrained's key prefix


def import_peft() -> Any:
    """The peft package, or an error saying how to install it (LoRA is the only user)."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("actor_rollout_ref.model.lora_rank > 0 needs Hugging Face PEFT: "
                          "`pip install peft -c requirements-lock.txt` (it is in requirements.txt)") from err
    return peft


_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")   # the trained parts of a LoRA / DoRA linear


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter parameter's name (lora_A / lora_B, DoRA's magnitude vector; any adapter)."""
    return any(f".{part}." in name for part in _ADAPTER_PARTS)


def peft_file_key(name: str) -> str:
    """An adapter parameter's key in PEFT's adapter_model.safetensors (PeftModel.save_pretrained's
    spelling): the adapter's name dropped, the prefix added; DoRA's magnitude without `.weight`."""
    key = name.replace(f".{ADAPTER_NAME}.", ".")
    if key.endswith(".lora_magnitude_vector.weight"):
        key = key.removesuffix(".weight")
    return _PEFT_PREFIX + key


def checkpoint_name(name: str) -> str:
    """A LoRA-injected model's parameter name as the base checkpoint spells it."""
    return name.replace(".base_layer.", ".")


# adapter_config.json fields, beside r / lora_alpha / target_modules / exclude_modules, that the adapter
# is built from, as PeftModel.from_pretrained builds it (PEFT's injection reads them)
SAVED_FIELDS_BUILT = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform",
                      "layers_pattern")
# fields that change nothing a loaded adapter computes (metadata; how PEFT initialised the weights before
# they were trained; training-only dropout: RL here trains without dropout)
SAVED_FIELDS_IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
                        "revision", "inference_mode", "runtime_config", "megatron_core", "qalora_group_size",
                        "loftq_config", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
                        "lora_dropout", "init_lora_weights")
# fields refused when set, with what they would need that the loader, the merge and the push do not do
SAVED_FIELDS_REFUSED = {
    "modules_to_save": "fully trained copies of whole modules, which the sharded load, the merge and the push "
                       "do not carry",
    "bias": "trained biases, which nothing here loads, trains or merges",
    "lora_bias": "a trained bias on lora_B, which the merge and the push leave out",
    "fan_in_fan_out": "Conv1D (GPT-2 style) weights stored transposed; the merge reads nn.Linear weights",
    "target_parameters": "LoRA on bare parameters (MoE experts), which the loader does not name",
    "trainable_token_indices": "trained rows of the token embedding, which the loader and the merge do not carry",
    "layer_replication": "layers duplicated at load, which the sharded load does not build",
    "megatron_config": "Megatron parallel linears",
    "use_qalora": "quantization-aware LoRA (QALoRA)",
    "alora_invocation_tokens": "activated LoRA (adapting only after an invocation sequence)",
    "arrow_config": "Arrow routing between adapters",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA (an SVD of the base weight and a learned diagonal between A and B)",
    "velora_config": "VeLoRA (a compressed-activation backward)",
    "monteclora_config": "MonteCLoRA (sampled adapters)",
}
# init_lora_weights values that only chose the adapter's first weights; the others (PiSSA, OLoRA, CorDA,
# LoftQ) also change the base weights whenever PEFT loads the adapter
_WEIGHT_ONLY_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
EMBEDDING_MODULES = ("embed_tokens", "lm_head")   # the names a causal LM gives its input / output embeddings
# LoRA on these would need embedding adapters in the loader and the merge, and a LoRA-aware fused head
EMBEDDING_REASON = ("LoRA on the input embedding or the output head is not supported: the sharded load and "
                     "the merge handle linear adapters only, the fused log-prob head needs a plain nn.Linear "
                     "lm_head, and a tied checkpoint cannot hold a separate lm_head delta; leave it out of "
                     "target_modules")


def _is_set(value: Any) -> bool:
    return value not in (None, False, "none", "", {}, [])


def saved_adapter_errors(saved: dict[str, Any], where: str) -> list[str]:
    """Why a saved adapter_config.json (`where`: how to name it) would compute otherwise here than under
    PeftModel.from_pretrained: each refused field by name; [] for an adapter this loader rebuilds exactly."""
    known = {"r", "lora_alpha", "target_modules", "exclude_modules", *SAVED_FIELDS_BUILT, *SAVED_FIELDS_IGNORED}
    errors = []
    for name, value in saved.items():
        if name in SAVED_FIELDS_REFUSED and _is_set(value):
            errors.append(f"{where}: {name}={value!r}: {SAVED_FIELDS_REFUSED[name]}")
        elif name not in known and name not in SAVED_FIELDS_REFUSED and _is_set(value):
            errors.append(f"{where}: {name}={value!r} is a field this loader does not know (PEFT "
                          f"{saved.get('peft_version', '?')}); it might change what the adapter computes")
    init = saved.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _WEIGHT_ONLY_INITS:
        errors.append(f"{where}: init_lora_weights={init!r} changes the base weights whenever PEFT loads the "
                      "adapter; convert it to a plain LoRA adapter (PEFT's "
                      "path_initial_model_for_weight_conversion) to continue from it")
    targets = saved.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    embedding = sorted(n for n in names if isinstance(n, str) and n.rsplit(".", 1)[-1] in EMBEDDING_MODULES)
    if embedding:
        errors.append(f"{where}: target_modules holds {embedding}: {EMBEDDING_REASON}")
    return errors


@dataclass(frozen=True)
class LoraSpec:
    """What LoRA to put into the actor: veRL's keys, read once; with `adapter_path`, the saved adapter's
    own adapter_config.json (rank, alpha, targets and SAVED_FIELDS_BUILT)."""

    rank: int
    alpha: float
    target_modules: Any          # "all-linear" or a list of module names
    exclude_modules: Any = None
    adapter_path: str | None = None
    use_rslora: bool = False     # scaling alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False       # DoRA: a trained magnitude per output row (saved adapters only)
    rank_pattern: dict[str, int] = field(default_factory=dict)      # per-module r
    alpha_pattern: dict[str, float] = field(default_factory=dict)   # per-module alpha
    layers_to_transform: Any = None
    layers_pattern: Any = None

    @classmethod
    def from_model_config(cls, model_cfg: Any) -> LoraSpec | None:
        """None when `lora_rank` is 0 (LoRA off). With `lora_adapter_path`, the adapter's own
        adapter_config.json gives rank, alpha, targets and the rest (its weights must fit them)."""
        rank = int(model_cfg.get("lora_rank", 0) or 0)
        if rank <= 0:
            return None
        adapter_path = model_cfg.get("lora_adapter_path")
        if adapter_path:
            return cls.from_saved(str(adapter_path))
        target = model_cfg.get("target_modules", "all-linear")
        target = target if isinstance(target, str) else [str(t) for t in target]
        exclude = model_cfg.get("exclude_modules")
        exclude = exclude if exclude is None or isinstance(exclude, str) else [str(t) for t in exclude]
        return cls(rank, float(model_cfg.get("lora_alpha", 16)), target, exclude)

    @classmethod
    def from_saved(cls, folder: str) -> LoraSpec:
        """The spec PeftModel.from_pretrained would build from `folder`'s adapter_config.json; a field it
        would honour and this loader cannot is refused by name (saved_adapter_errors)."""
        saved = read_adapter_config(folder)
        errors = saved_adapter_errors(saved, f"actor_rollout_ref.model.lora_adapter_path={folder!r} "
                                             f"({os.path.join(folder, ADAPTER_CONFIG)})")
        if errors:
            raise ValueError("; ".join(errors))
        target = saved.get("target_modules", "all-linear")
        target = sorted(target) if isinstance(target, list) else target
        return cls(int(saved["r"]), float(saved["lora_alpha"]), target, saved.get("exclude_modules"), folder,
                   use_rslora=bool(saved.get("use_rslora", False)), use_dora=bool(saved.get("use_dora", False)),
                   rank_pattern=dict(saved.get("rank_pattern") or {}),
                   alpha_pattern=dict(saved.get("alpha_pattern") or {}),
                   layers_to_transform=saved.get("layers_to_transform"), layers_pattern=saved.get("layers_pattern"))

    @property
    def scaling(self) -> float:
        """The scaling of a module outside the patterns (PEFT's layer.scaling holds each module's own)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def max_rank(self) -> int:
        """The largest rank of any adapted module (rank_pattern may raise some above `rank`)."""
        return max([self.rank, *self.rank_pattern.values()])

    def peft_config(self) -> Any:
        peft = import_peft()
        kwargs: dict[str, Any] = {"r": self.rank, "lora_alpha": self.alpha, "target_modules": self.target_modules,
                                  "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
                                  "use_rslora": self.use_rslora, "use_dora": self.use_dora,
                                  "rank_pattern": dict(self.rank_pattern), "alpha_pattern": dict(self.alpha_pattern)}
        for key in ("exclude_modules", "layers_to_transform", "layers_pattern"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return peft.LoraConfig(**kwargs)

    def inject(self, module: nn.Module, frozen_dtype: torch.dtype | None = None) -> nn.Module:
        """PEFT's LoRA layers into `module` in place; everything else frozen (in `frozen_dtype` if
        given). Works on a model whose parameters are on the meta device."""
        peft = import_peft()
        embeddings = {id(m) for m in (module.get_input_embeddings(), module.get_output_embeddings())
                      if m is not None} if hasattr(module, "get_input_embeddings") else set()
        try:
            peft.inject_adapter_in_model(self.peft_config(), module, adapter_name=ADAPTER_NAME)
        except ValueError as err:   # PEFT's own message does not name our key
            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} / exclude_modules="
                             f"{self.exclude_modules!r} matched no module of {type(module).__name__}: {err}") from err
        wrapped = sorted(name for name, layer in module.named_modules()
                         if isinstance(layer, peft.tuners.lora.LoraLayer)
                         and (id(layer.get_base_layer()) in embeddings or isinstance(layer, peft.tuners.lora.Embedding)))
        if wrapped:
            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} adapts {wrapped}: "
                             f"{EMBEDDING_REASON}")
        # PEFT also wraps modules that are no nn.Linear: an MoE layer's fused experts and its router.
        unsupported = sorted(name for name, layer in module.named_modules()
                             if isinstance(layer, peft.tuners.lora.LoraLayer)
                             and not isinstance(layer.get_base_layer(), nn.Linear))
        if unsupported:
            from verl.utils.memory_plan_lora import MOE_LORA_REASON

            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} adapts "
                             f"{unsupported[:4]}{' ...' if len(unsupported) > 4 else ''}: {MOE_LORA_REASON}")
        adapters = 0
        for name, param in module.named_parameters():
            if is_adapter_param(name):
                param.requires_grad_(True)
                adapters += 1
            else:
                param.requires_grad_(False)
                if frozen_dtype is not None and param.dtype != frozen_dtype and param.is_floating_point():
                    param.data = param.data.to(frozen_dtype)
        if adapters == 0:
            raise ValueError(f"actor_rollout_ref.model.target_modules={self.target_modules!r} matched no module of "
                             f"{type(module).__name__}: LoRA would train nothing")
        return module

    def init_adapter(self, owner_name: str, replica: nn.Module) -> bool:
        """Initialise one adapter part (`owner_name` ends in lora_A.<adapter>, lora_B.<adapter> or DoRA's
        lora_magnitude_vector.<adapter>), a CPU replica: from `adapter_path` if given, else as PEFT does
        (A Kaiming-uniform, B zero). False for a module that is no adapter part."""
        part = owner_name.rsplit(".", 2)
        if len(part) < 3 or part[1] not in _ADAPTER_PARTS:
            return False
        weight = replica.weight
        if part[1] == "lora_magnitude_vector" and not self.adapter_path:
            raise ValueError(f"{owner_name}: DoRA's magnitude starts from a saved adapter only (lora_adapter_path)")
        if self.adapter_path:
            saved = _adapter_tensors(self.adapter_path)
            key = peft_file_key(f"{owner_name}.weight")
            if key not in saved:
                raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={self.adapter_path}: no tensor {key} "
                                 "(the adapter was trained on another model or other target_modules)")
            if tuple(saved[key].shape) != tuple(weight.shape):
                raise ValueError(f"lora_adapter_path: {key} has shape {tuple(saved[key].shape)}, the model's "
                                 f"adapter {tuple(weight.shape)}")
            weight.data.copy_(saved[key])
        elif part[1] == "lora_A":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            nn.init.zeros_(weight)
        return True


_ADAPTER_CACHE: dict[tuple[str, float], dict[str, torch.Tensor]] = {}


def _adapter_tensors(folder: str) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors under PeftModel.save_pretrained's keys, read once per file version
    (one load initialises every adapter linear from it)."""
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _ADAPTER_CACHE:
        from safetensors.torch import load_file

        _ADAPTER_CACHE.clear()   # only the latest adapter stays in memory
        _ADAPTER_CACHE[key] = {k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k: v
                               for k, v in load_file(path).items()}
    return _ADAPTER_CACHE[key]


def read_adapter_config(folder: str) -> dict[str, Any]:
    """A saved adapter's adapter_config.json, checked to be a LoRA adapter with its weights beside it."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise FileNotFoundError(f"{folder}: a LoRA adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    with open(path) as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}, not a LoRA adapter")
    return config


def lora_layers(module: nn.Module) -> list[nn.Module]:
    peft = import_peft()
    return [m for m in module.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def has_lora(module: nn.Module) -> bool:
    return any(is_adapter_param(name) for name, _ in module.named_parameters())


@contextmanager
def adapter_disabled(module: nn.Module) -> Iterator[None]:
    """Inside: `module` computes as its base model (every LoRA layer bypassed). The flag PEFT's own
    `disable_adapter()` sets, without its requires_grad toggling (the FSDP2 parameters stay as they are)."""
    layers = lora_layers(module)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (an FSDP2 shard's local tensor, or the tensor itself)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` as FSDP2 shards `param` (dim-0 style chunks of torch.chunk, as the
    sharded load copies them); `full` itself for a plain tensor."""
    if not hasattr(param, "device_mesh"):
        return full
    (placement,) = param.placements
    mesh = param.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=placement.dim)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full.narrow(placement.dim, 0, 0)


class FrozenAdapter:
    """The adapter `spec.adapter_path` holds, as this rank's shards in host memory: the KL reference of a
    run that continues from it (`actor_rollout_ref.ref.lora_reference=start_adapter`). Read from the file,
    not the live module, so a resumed run's reference is still the adapter it started from. Costs one
    adapter shard of host memory; `swapped_in` copies it into the actor's adapter and back (no second model).

        frozen = FrozenAdapter(spec, module)
        with frozen.swapped_in(module):
            ref_log_probs = actor.compute_log_prob(batch)
    """

    def __init__(self, spec: LoraSpec, module: nn.Module) -> None:
        if not spec.adapter_path:
            raise ValueError("the starting adapter as reference needs actor_rollout_ref.model.lora_adapter_path")
        saved = _adapter_tensors(spec.adapter_path)
        self._pieces: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if not is_adapter_param(name):
                continue
            key = peft_file_key(name)
            if key not in saved or tuple(saved[key].shape) != tuple(param.shape):
                raise ValueError(f"lora_adapter_path={spec.adapter_path}: {key} is missing or does not fit the "
                                 f"actor's {name} {tuple(param.shape)}")
            piece = _shard_of(param, saved[key])
            self._pieces[name] = piece.to(device="cpu", dtype=param.dtype, copy=True).contiguous()
        if not self._pieces:
            raise ValueError("the actor has no LoRA adapter to swap a starting adapter into")

    @contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        """Inside: `module`'s adapter is the starting one; the live adapter (kept on the host meanwhile)
        is copied back on exit, bit for bit."""
        params = {name: p for name, p in module.named_parameters() if is_adapter_param(name)}
        if set(params) != set(self._pieces):
            raise RuntimeError("the actor's adapter parameters changed since the starting adapter was read")
        live: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in params.items():
                local = _local(param)
                if tuple(local.shape) != tuple(self._pieces[name].shape):
                    raise RuntimeError(f"{name}: this rank holds {tuple(local.shape)}, the starting adapter's "
                                       f"shard is {tuple(self._pieces[name].shape)} (swap while sharded)")
                live[name] = local.detach().to("cpu", copy=True)
                local.copy_(self._pieces[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in params.items():
                    _local(param).copy_(live[name])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def lora_scalings(module: nn.Module) -> dict[str, float]:
    """Each LoRA-wrapped module's scaling, by its name (PEFT's: alpha / r, rsLoRA's alpha / sqrt(r), with
    rank_pattern / alpha_pattern applied)."""
    return {name: float(layer.scaling[ADAPTER_NAME]) for name, layer in module.named_modules()
            if hasattr(layer, "lora_A") and ADAPTER_NAME in getattr(layer, "scaling", {})}


def merged_weight(name: str, full: torch.Tensor, state: dict[str, torch.Tensor],
                  scaling: dict[str, float]) -> torch.Tensor | None:
    """W + scaling * B @ A in fp32 when `name` is a LoRA-wrapped linear's base weight (`full`: that
    weight gathered; the adapter's factors are gathered from `state`, a collective), else None.
    DoRA: each output row of it then rescaled to the trained magnitude (PEFT's merge)."""
    owner, _, local = name.rpartition(".base_layer.")
    if local != "weight" or owner not in scaling:
        return None
    a = _full(state[f"{owner}.lora_A.{ADAPTER_NAME}.weight"]).float()
    b = _full(state[f"{owner}.lora_B.{ADAPTER_NAME}.weight"]).float()
    merged = full.float() + scaling[owner] * (b @ a)
    magnitude = state.get(f"{owner}.lora_magnitude_vector.{ADAPTER_NAME}.weight")
    if magnitude is not None:   # (out,): the row norms DoRA's forward divides by, then the learned ones
        merged = merged * (_full(magnitude).float() / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
    return merged


def merged_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) of the adapted model: each LoRA-wrapped weight merged
    (W + scaling * B @ A, in W's dtype), the adapters left out; other entries as they are. Every rank
    must iterate it to the end (gathering a shard is a collective)."""
    state = module.state_dict()
    scaling = lora_scalings(module)
    for name, tensor in state.items():
        if is_adapter_param(name):
            continue
        full = _full(tensor)
        merged = merged_weight(name, full, state, scaling)
        yield checkpoint_name(name), full if merged is None else merged.to(full.dtype)


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full tensors under PeftModel.save_pretrained's keys (a collective, as merged_state)."""
    out = {}
    for name, tensor in module.state_dict().items():
        if is_adapter_param(name):
            out[peft_file_key(name)] = _full(tensor).float().contiguous().cpu()
    return out


def save_adapter(tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str, folder: str) -> None:
    """adapter_model.safetensors + adapter_config.json (PEFT's format) into `folder`."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS))
    config = spec.peft_config()
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(folder)
