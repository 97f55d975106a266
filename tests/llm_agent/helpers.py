"""Helpers shared by the generation-manager tests: the fixed corpus, prompts, batches."""

from __future__ import annotations

import torch

from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from verl.protocol import DataProto
from verl.utils import batch_keys as K

CORPUS = [
    {"id": "0", "contents": '"Paris"\n' + 'Paris is the capital of France and its largest city. ' * 8},
    {"id": "1", "contents": '"Eiffel Tower"\n' + 'The Eiffel Tower is a lattice tower in Paris, built in 1889. ' * 8},
    {"id": "2", "contents": '"Berlin"\n' + 'Berlin is the capital of Germany, on the river Spree. ' * 8},
    {"id": "3", "contents": '"Rome"\n' + 'Rome is the capital of Italy and was founded long ago. ' * 8},
    {"id": "4", "contents": '"Madrid"\n' + 'Madrid is the capital of Spain, in the centre of the country. ' * 8},
]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, key: str, instructions: str = "Answer the given question. ") -> list[int]:
    """A ChatML prompt whose question carries the scripted engine's row key."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{instructions}Question: {key}?"}],
                                         add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text)


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with `template` as its chat template."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def make_gen_batch(tokenizer, keys: list[str], **meta) -> tuple[DataProto, torch.Tensor]:
    """A left-padded generation batch for `keys`, and its input_ids (the prompts)."""
    ids, mask = left_pad([prompt_ids(tokenizer, k) for k in keys], tokenizer.pad_token_id)
    batch = DataProto.from_dict(
        tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.POSITION_IDS: position_ids_from_mask(mask)},
        meta_info=dict(meta),
    )
    return batch, ids


def teach_one_trajectory(root, row: dict) -> str:
    """SFT the HF model in `root/init` on `row` (prompt + policy/observation turns; loss on policy
    tokens only) until it repeats it greedily; returns the checkpoint folder. Used by the engine
    tests that need a small model which follows one multi-turn trajectory."""
    import pandas as pd

    from verl.trainer.fsdp_sft_trainer import compose_sft_config, run_sft

    pd.DataFrame([row] * 2).to_parquet(root / "sft.parquet")
    cfg = compose_sft_config([
        f"data.train_files={root / 'sft.parquet'}", "data.train_batch_size=2", "data.micro_batch_size_per_gpu=2",
        "data.max_length=1024", f"model.partial_pretrain={root / 'init'}", "optim.lr=1e-2",
        "optim.warmup_steps_ratio=0.05", "data.loss_weights.observation=0.0", "data.loss_weights.prompt=0.0",
        "trainer.total_training_steps=80", f"trainer.default_local_dir={root / 'sft'}", "trainer.log_freq=20",
        "trainer.device=cpu", "trainer.num_threads=1"])
    return str(run_sft(cfg).checkpoint_dir)
