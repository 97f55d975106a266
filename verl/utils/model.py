"""Load the policy / reference / critic models from a local Hugging Face folder.

    actor = load_causal_lm(cfg.model.path, cfg.model.override_config, torch.float32)
    critic = load_value_model(cfg.model.path, cfg.model.override_config, torch.float32)
    info = get_model_flops_info(actor)    # hidden size, layers, parameter count, for MFU

`load_*` read the weights in this process (`from_pretrained`: the whole model, for one process).
The workers instead build the architecture with `build_*` on the meta device and receive their
shards from rank 0 (`verl/utils/sharded_init.py`), so no rank holds the whole model.

Attention: `attn_implementation` (verl/utils/attention.py: the registered packed attention,
verl/utils/packed_attention.py, when packing) is passed to Hugging Face; if it refuses it, packing (`use_remove_padding`) is an error
naming the key, and otherwise the model's default kernel is used, with a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.modeling_outputs import TokenClassifierOutput

from verl.utils.attention import FLASH_ATTN_INSTALL, PACKED_ATTENTION, PACKED_FLASH_ATTENTION

logger = logging.getLogger(__name__)

ACTOR_PACKING_KEY = "actor_rollout_ref.model.use_remove_padding"
CRITIC_PACKING_KEY = "critic.model.use_remove_padding"


def _plain_dict(override_config: Any) -> dict[str, Any]:
    if override_config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(override_config, DictConfig):
            return dict(OmegaConf.to_container(override_config, resolve=True))
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return dict(override_config)


def load_model_config(path: str, override_config: Any = None, **extra: Any) -> Any:
    """AutoConfig of `path` with `override_config` (and `extra`) applied; unknown keys are still set."""
    config = AutoConfig.from_pretrained(path)
    for key, value in {**_plain_dict(override_config), **extra}.items():
        setattr(config, key, value)
    return config


def value_model_config(path: str, override_config: Any = None) -> Any:
    """The critic's config: one label (the value), and classifier_dropout 0 unless overridden:
    dropout on the value head would make values random in training mode and differ between the
    compute and update passes."""
    overrides = {"classifier_dropout": 0.0, **_plain_dict(override_config)}
    return load_model_config(path, overrides, num_labels=1)


def load_causal_lm(path: str, override_config: Any = None, dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None, use_remove_padding: bool = False) -> nn.Module:
    """The policy (or reference) model: AutoModelForCausalLM in `dtype`, weights read here."""
    # A fresh config per attempt: Hugging Face writes the refused attn_implementation into it.
    return _instantiate(
        lambda attn: AutoModelForCausalLM.from_pretrained(
            path, config=load_model_config(path, override_config), dtype=dtype, **attn),
        attn_implementation, use_remove_padding, ACTOR_PACKING_KEY)


def build_causal_lm(path: str, override_config: Any = None, attn_implementation: str | None = None,
                    use_remove_padding: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The policy's architecture with its parameters in `dtype` (fp32: the actor's master weights; the
    reference's: `frozen_weight_dtype`) and its constructor's weights (none under
    `sharded_init.parameters_on_meta`): the checkpoint is loaded separately, cast to `dtype`. Buffers
    keep the dtype the model gives them (the rotary tables stay fp32)."""
    return _instantiate(
        lambda attn: AutoModelForCausalLM.from_config(load_model_config(path, override_config),
                                                      dtype=dtype, **attn),
        attn_implementation, use_remove_padding, ACTOR_PACKING_KEY)


def frozen_weight_dtype(device: str) -> torch.dtype:
    """The dtype of a model nobody trains (the reference policy), as veRL builds it: on CUDA bf16, the
    dtype FSDP2's mixed precision computes in (fsdp_utils.gpu_mixed_precision), so its forward uses the
    values an fp32 copy would be cast to, for half the memory and none of an optimizer's need for fp32
    masters; fp32 on CPU, where the workers compute in fp32."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _packing_refused_hint(attn_implementation: str, packing_key: str) -> str:
    """What to do when the kernel packing asked for is refused; true for that kernel: only flash-attn's
    needs the flash-attn package (the registered packed attention runs torch's varlen_attn on CUDA,
    one sdpa call per sequence on CPU)."""
    kernel_key = packing_key.rsplit(".", 1)[0] + ".packing_kernel"
    off = f"or set {packing_key}=False"
    if attn_implementation == PACKED_FLASH_ATTENTION:
        return (f"{kernel_key}=flash_attn needs flash-attn: install it with `{FLASH_ATTN_INSTALL}` (after a CUDA "
                f"torch; docs/training.md, 'Installing on GPUs'), or set {kernel_key}=varlen_attn (torch's own "
                f"kernel, no extra package), {off}")
    if attn_implementation == PACKED_ATTENTION:
        return ("packing needs no extra package (torch's varlen_attn on CUDA, one sdpa call per sequence on CPU) "
                "but the implementation must be registered first (verl.utils.attention.attn_implementation "
                "registers it) and the model's class must accept a registered attention implementation: use "
                f"such a model, {off}")
    if "flash" in attn_implementation:
        return (f"install flash-attn with `{FLASH_ATTN_INSTALL}` (after a CUDA torch; docs/training.md, "
                f"'Installing on GPUs'), or load with the registered packed attention ({PACKED_ATTENTION!r}: "
                f"no extra package; verl.utils.attention.attn_implementation), {off}")
    return (f"load with the registered packed attention ({PACKED_ATTENTION!r}: no extra package; "
            f"verl.utils.attention.attn_implementation), {off}")


def _instantiate(make: Callable[[dict[str, Any]], nn.Module], attn_implementation: str | None,
                 use_remove_padding: bool, packing_key: str) -> nn.Module:
    """make({"attn_implementation": ...}), or make({}) for the model's default kernel when
    Hugging Face refuses the one asked for and no packing depends on it."""
    if not attn_implementation:
        return make({})
    try:
        return make({"attn_implementation": attn_implementation})
    except (ImportError, ValueError) as err:
        if use_remove_padding:
            # Packed rows need the varlen kernel: sdpa would attend across the packed sequences
            # (one causal window over the whole micro-batch) or fail later with a shape error.
            raise ValueError(
                f"{packing_key}=True needs attn_implementation={attn_implementation!r}, which Hugging Face "
                f"refused ({type(err).__name__}: {err}); {_packing_refused_hint(attn_implementation, packing_key)}"
            ) from err
        # e.g. flash-attn built for another CUDA: sdpa is slower but equally correct without packing.
        logger.warning("attn_implementation=%s unavailable (%s); using the model's default", attn_implementation, err)
        return make({})


class CausalLMWithValueHead(nn.Module):
    """Fallback critic for architectures with no token-classification class: backbone + linear value head."""

    base_model_prefix = "model"   # the backbone's weights are "model.*", as in a causal-LM checkpoint

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1)
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)
        self.config = backbone.config

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> TokenClassifierOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return TokenClassifierOutput(logits=self.score(out.last_hidden_state))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def load_value_model(path: str, override_config: Any = None, dtype: torch.dtype = torch.float32,
                     attn_implementation: str | None = None, use_remove_padding: bool = False) -> nn.Module:
    """Critic: AutoModelForTokenClassification with one label (the value), else backbone + value
    head; weights read here (the value head is initialised fresh: seed the RNG first)."""
    # A fresh config per attempt: Hugging Face writes the refused attn_implementation into it.
    def config() -> Any:
        return value_model_config(path, override_config)

    if _has_token_classification(config()):
        return _instantiate(
            lambda attn: AutoModelForTokenClassification.from_pretrained(path, config=config(), dtype=dtype, **attn),
            attn_implementation, use_remove_padding, CRITIC_PACKING_KEY)
    backbone = _instantiate(lambda attn: AutoModel.from_pretrained(path, config=config(), dtype=dtype, **attn),
                            attn_implementation, use_remove_padding, CRITIC_PACKING_KEY)
    return CausalLMWithValueHead(backbone, backbone.config.hidden_size).to(dtype)


def build_value_model(path: str, override_config: Any = None, attn_implementation: str | None = None,
                      use_remove_padding: bool = False) -> nn.Module:
    """The critic's architecture in fp32 (`load_value_model`'s), without reading the checkpoint."""
    def config() -> Any:
        return value_model_config(path, override_config)

    if _has_token_classification(config()):
        return _instantiate(
            lambda attn: AutoModelForTokenClassification.from_config(config(), dtype=torch.float32, **attn),
            attn_implementation, use_remove_padding, CRITIC_PACKING_KEY)
    backbone = _instantiate(lambda attn: AutoModel.from_config(config(), dtype=torch.float32, **attn),
                            attn_implementation, use_remove_padding, CRITIC_PACKING_KEY)
    return CausalLMWithValueHead(backbone, backbone.config.hidden_size).to(torch.float32)


def _has_token_classification(config: Any) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    return config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES


@dataclass(frozen=True)
class ModelFlopsInfo:
    """What the driver needs to estimate FLOPs / MFU of a step."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    vocab_size: int
    num_params: int


def get_model_flops_info(module: nn.Module) -> ModelFlopsInfo:
    config = module.config
    return ModelFlopsInfo(
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_attention_heads=int(config.num_attention_heads),
        vocab_size=int(config.vocab_size),
        num_params=int(sum(math.prod(p.shape) for p in module.parameters())),
    )
