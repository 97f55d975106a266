"""LoRA on a mixture-of-experts model (verl/utils/lora.py): PEFT adapts its attention as on a dense
model; its routed experts (transformers 5's fused 3-D parameters, which PEFT 0.21 wraps as ParamWrapper,
as `all-linear` does) and its router are refused at injection, naming the key and the reason."""

from __future__ import annotations

import pytest

from verl.utils.lora import LoraSpec, is_adapter_param
from verl.utils.tiny_model import build_tiny_model, train_bpe_tokenizer

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_lora_on_an_moes_attention_adapts_only_the_attention() -> None:
    model = build_tiny_model(train_bpe_tokenizer(), "qwen3_moe")
    LoraSpec(rank=4, alpha=8, target_modules=ATTENTION).inject(model)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters()
               if is_adapter_param(name)}
    assert adapted == set(ATTENTION)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".experts." in n or ".gate." in n)


@pytest.mark.parametrize(("target", "reason"), [
    ("all-linear", "routed experts.*nn.Linear layers only"),     # PEFT wraps the fused experts and the router
    (["gate"], "routed experts.*nn.Linear layers only"),         # the router alone
    (["q_proj", "experts"], "Qwen3MoeExperts.*is not supported"),  # PEFT itself refuses the experts module by name
])
def test_lora_on_an_moes_experts_or_router_is_refused_with_the_reason(target, reason: str) -> None:
    model = build_tiny_model(train_bpe_tokenizer(), "qwen3_moe")
    with pytest.raises(ValueError, match=rf"(?s)actor_rollout_ref.model.target_modules=.*{reason}"):
        LoraSpec(rank=4, alpha=8, target_modules=target).inject(model)
