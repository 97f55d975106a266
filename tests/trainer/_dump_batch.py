"""A trained-on batch as the trainer holds it at the end of a step, without a model: the generation
manager rolls out scripted token streams against a real BM25 server, the rule reward scores them
and GRPO's advantages are computed; old log-probs are made up (no model here). Shared by the dump
tests and the viewer's browser tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scripts.bench.rollout import ScriptedRollout, serve_bm25
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from tests.llm_agent.helpers import CORPUS, encode, make_gen_batch
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.reward import RewardManager
from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts
from verl.utils import batch_keys as K

MAX_RESPONSE = 64
# What a page or a policy can write: markup that must stay text in the viewer.
HOSTILE = '</script><img src=x onerror="window.__pwned=1"><b>bold</b>'


def make_tokenizer() -> Any:
    from verl.utils.tiny_model import DEFAULT_TEXTS, train_bpe_tokenizer

    return train_bpe_tokenizer(list(DEFAULT_TEXTS) + [c["contents"] for c in CORPUS], vocab_size=700)


@contextmanager
def bm25_url(folder: Path) -> Iterator[str]:
    corpus = [*CORPUS, {"id": "5", "contents": f'"Markup"\nA page that holds {HOSTILE} as text. ' * 3}]
    with serve_bm25(corpus, folder, topk=2) as url:
        yield url


def scripts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """q1 searches twice and answers right; q2 writes an invalid action, then answers wrong; q3 emits
    EOS; q4 searches for a page holding markup and answers with markup."""
    enc = lambda s: encode(tokenizer, s)  # noqa: E731
    eos = tokenizer.eos_token_id
    return {
        "q1": [enc("<think> look </think><search> capital of France </search>"),
               enc("<think> more </think><search> Eiffel Tower </search>"),
               enc("<think> done </think><answer> Paris </answer>") + [eos]],
        "q2": [enc("<think> I wonder </think> nothing"), enc("<answer> Rome </answer>") + [eos]],
        "q3": [enc("<think> bye </think>") + [eos]],
        "q4": [enc("<search> Markup page </search>"), enc(f"<answer> {HOSTILE} </answer>") + [eos]],
    }


def rolled_out_batch(tokenizer: Any, url: str, keys: tuple[str, ...] = ("q1", "q2", "q3", "q4"),
                     samples: int = 2, seed: int = 0) -> DataProto:
    """`samples` rollouts of each key (one GRPO group per key), scored and with advantages."""
    config = GenerationConfig(max_turns=2, max_start_length=256, max_prompt_length=4096,
                              max_response_length=MAX_RESPONSE, max_obs_length=512, search_url=url, topk=2,
                              retrieval_timeout=10.0, retrieval_max_retries=0)
    rows = [k for k in keys for _ in range(samples)]
    gen_batch, prompts = make_gen_batch(tokenizer, rows, do_sample=False)
    out = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, scripts(tokenizer)), config).run_llm_loop(
        gen_batch, prompts)
    out.meta_info = {}
    n = len(rows)
    uids = {k: str(uuid.uuid4()) for k in keys}
    out.non_tensor_batch.update({
        K.DATA_SOURCE: np.array(["nq" if k != "q2" else "hotpotqa" for k in rows], dtype=object),
        K.UID: np.array([uids[k] for k in rows], dtype=object),
        K.REWARD_MODEL: np.array([{"style": "rule", "ground_truth": {"target": ["Paris"]}} for _ in rows], dtype=object),
        K.EXTRA_INFO: np.array([{"split": "train", "index": int(k[1:])} for k in rows], dtype=object),
    })
    out.batch[K.RESPONSE_MASK] = out.batch[K.LOSS_MASK].clone()
    score_rollouts(RewardManager(tokenizer, num_examine=0), out, OverlongBuffer(), MAX_RESPONSE)
    scores_BR = out.batch[K.TOKEN_LEVEL_SCORES]
    out.batch[K.TOKEN_LEVEL_REWARDS] = scores_BR
    # one row of each group right, one wrong would give +-1; q1's rows both score 1, q3's both 0: the
    # advantages of those groups are 0. A made-up per-token ramp on q1's first row stands in for GAE.
    adv_BR, _ = core_algos.compute_grpo_outcome_advantage(scores_BR, out.batch[K.RESPONSE_MASK],
                                                         out.non_tensor_batch[K.UID])
    adv_BR[0] += torch.linspace(-0.5, 0.5, adv_BR.shape[1]) * out.batch[K.RESPONSE_MASK][0]
    out.batch[K.ADVANTAGES] = adv_BR
    gen = torch.Generator().manual_seed(seed)
    out.batch[K.OLD_LOG_PROBS] = -torch.rand(out.batch[K.RESPONSES].shape, generator=gen) * 3 * out.batch[K.LOSS_MASK]
    assert len(out) == n
    return out
