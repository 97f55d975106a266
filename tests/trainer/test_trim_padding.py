"""Dropping prompt columns that are padding in every row changes no response log-prob."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from verl.protocol import DataProto
from verl.trainer.ppo.rollout_setup import trim_shared_left_padding
from verl.utils.torch_functional import compute_position_id_with_mask, logprobs_from_logits


def _batch(pad_id: int) -> DataProto:
    # Prompts left-padded to 8 columns, longest prompt 5 tokens -> 3 shared pad columns.
    prompts = torch.tensor([[pad_id] * 3 + [11, 12, 13, 14, 15], [pad_id] * 5 + [21, 22, 23]])
    responses = torch.tensor([[31, 32, 33, pad_id], [41, 42, 43, 44]])
    attention = torch.cat([(prompts != pad_id).long(), (responses != pad_id).long()], dim=-1)
    input_ids = torch.cat([prompts, responses], dim=-1)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
        "position_ids": compute_position_id_with_mask(attention), "info_mask": attention.clone(),
    })


def _response_logprobs(model, batch: DataProto) -> torch.Tensor:
    b = batch.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    r = b["responses"].shape[-1]
    return logprobs_from_logits(logits[:, -r - 1:-1], b["responses"])


def test_only_columns_padded_in_every_row_are_dropped(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    pad_id = model.config.pad_token_id
    full = _batch(pad_id)
    trimmed = trim_shared_left_padding(_batch(pad_id))

    assert trimmed.batch["prompts"].shape[-1] == 5
    assert trimmed.batch["input_ids"].shape[-1] == full.batch["input_ids"].shape[-1] - 3
    assert torch.equal(trimmed.batch["responses"], full.batch["responses"])
    assert torch.equal(trimmed.batch["input_ids"], full.batch["input_ids"][:, 3:])
    assert trimmed.batch["attention_mask"].sum() == full.batch["attention_mask"].sum()

    mask = full.batch["attention_mask"][:, -4:].bool()
    with torch.no_grad():
        before, after = _response_logprobs(model, full), _response_logprobs(model, trimmed)
    # Same weights and tokens, shorter rows: only the GEMM/softmax blocking changes, which moves
    # fp32 log-probs (|x| <= log V ~ 6) by ~1e-6 on any CPU; 1e-5 keeps a 10x margin, while a
    # pad column that leaked into attention shifts them by > 1e-3.
    torch.testing.assert_close(after[mask], before[mask], rtol=1e-5, atol=1e-5)


def test_a_batch_without_shared_padding_is_unchanged(tiny_model_dir: str) -> None:
    pad_id = 0
    batch = _batch(pad_id)
    batch.batch["prompts"][0, 0] = 7          # row 0 now fills every prompt column
    batch.batch["attention_mask"][0, :8] = 1
    width = batch.batch["input_ids"].shape[-1]
    assert trim_shared_left_padding(batch).batch["input_ids"].shape[-1] == width
