"""Load the policy / reference / critic models from a local Hugging Face folder.

    actor = load_causal_lm(cfg.model.path, cfg.model.override_config, torch.float32)
    critic = load_value_model(cfg.model.path, cfg.model.override_config, torch.float32)
    info = get_model_flops_info(actor)    # hidden size, layers, parameter count, for MFU
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.modeling_outputs import TokenClassifierOutput

logger = logging.getLogger(__name__)


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


def load_causal_lm(path: str, override_config: Any = None, dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None) -> nn.Module:
    """The policy (or reference) model: AutoModelForCausalLM in `dtype`."""
    config = load_model_config(path, override_config)
    return _from_pretrained(AutoModelForCausalLM, path, config, dtype, attn_implementation)


def _from_pretrained(auto_cls: Any, path: str, config: Any, dtype: torch.dtype,
                     attn_implementation: str | None) -> nn.Module:
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype}
    if not attn_implementation:
        return auto_cls.from_pretrained(path, **kwargs)
    try:
        return auto_cls.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
    except (ImportError, ValueError) as err:
        # e.g. flash-attn built for another CUDA: sdpa is slower but equally correct.
        logger.warning("attn_implementation=%s unavailable (%s); using the default", attn_implementation, err)
        return auto_cls.from_pretrained(path, **kwargs)


class CausalLMWithValueHead(nn.Module):
    """Fallback critic for architectures with no token-classification class: backbone + linear value head."""

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
                     attn_implementation: str | None = None) -> nn.Module:
    """Critic: AutoModelForTokenClassification with one label (the value), else backbone + value head.

    classifier_dropout defaults to 0: dropout on the value head would make values
    random in training mode and differ between the compute and update passes.
    """
    overrides = {"classifier_dropout": 0.0, **_plain_dict(override_config)}
    config = load_model_config(path, overrides, num_labels=1)
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    if config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        return _from_pretrained(AutoModelForTokenClassification, path, config, dtype, attn_implementation)
    # No token-classification class is registered for this architecture.
    backbone = _from_pretrained(AutoModel, path, config, dtype, attn_implementation)
    return CausalLMWithValueHead(backbone, config.hidden_size).to(dtype)


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
