"""The async rollout's HF engine on CUDA (issue 32 item 11): what CPU tests pin by counting, checked
where it matters.

    pytest -m gpu tests/gpu/test_async_rollout_cuda.py      # one CUDA GPU; CI deselects `gpu`

- the batched seeded draw takes from each row's CUDA generator what one multinomial a row took;
- a decoding step synchronises the host with the GPU once, besides what the model's own forward
  does (torch's sync debug mode reports each synchronising call), with rows joining and leaving;
- stepped in AsyncEngine's worker thread, greedy requests that join a running batch get what
  step-by-step decoding gives.
The wall-clock ratio of async to sync on the demo is `python -m scripts.bench.async_rollout
--counters --device cuda` (docs/rollout.md "Sync and async on a GPU").
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _syncs(fn: Callable[[], object]) -> int:
    """How many synchronising CUDA calls `fn` makes (torch's sync debug mode warns once for each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def cuda_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([ids + out], device="cuda")).logits[0, -1].argmax()))
    return out


def _engine(model, tok, response_length: int):
    from tests.workers.test_hf_rollout import ROLLOUT_CFG
    from verl.utils import batch_keys as K
    from verl.workers.rollout.hf_rollout import HFRollout

    cfg = OmegaConf.create({**ROLLOUT_CFG, "response_length": response_length, "micro_batch_size": 8})
    return HFRollout(model, cfg, tok).step_engine({K.META_EOS_TOKEN_ID: -1, K.META_PAD_TOKEN_ID: tok.pad_token_id,
                                                   K.META_DO_SAMPLE: False})


def test_seeded_batched_draws_match_per_row_multinomial_on_cuda() -> None:
    from tests.workers.test_hf_rollout import seeded_draws_match_per_row_multinomial

    seeded_draws_match_per_row_multinomial("cuda")


def test_a_decoding_step_synchronises_once_besides_the_forward(cuda_model) -> None:
    from tests.workers.test_hf_rollout import TEXTS

    model, tok = cuda_model
    ids = [tok(t)["input_ids"] for t in TEXTS]
    probe = torch.tensor([ids[0]], device="cuda")
    with torch.no_grad():
        per_forward = _syncs(lambda: model(input_ids=probe))
    engine = _engine(model, tok, 8)
    engine.add("0", ids[0], seed=0)
    engine.add("1", ids[1], seed=0)
    engine.step()
    steps = 0

    def rest() -> None:
        nonlocal steps
        engine.step()
        engine.add("2", ids[2], seed=0)       # joins the running batch: a pinned, non-blocking copy
        engine.abort(["1"])                   # a row leaves: trimmed by host-side bookkeeping
        steps = 1
        while engine.has_unfinished():
            engine.step()
            steps += 1

    syncs = _syncs(rest)
    # One copy a step, the forwards' own (a decode forward each step, one prefill for "2").
    assert syncs <= steps * (1 + per_forward) + per_forward, (syncs, steps, per_forward)


def test_requests_joining_a_batch_stepped_off_the_loop_decode_as_alone(cuda_model) -> None:
    from tests.workers.test_async_engine import _staggered
    from tests.workers.test_hf_rollout import TEXTS
    from verl.workers.rollout.async_engine import AsyncEngine

    model, tok = cuda_model
    ids = [tok(t)["input_ids"] for t in TEXTS]
    outs = asyncio.run(_staggered(AsyncEngine(_engine(model, tok, 8)), ids, [0] * len(ids)))
    assert [o.token_ids for o in outs] == [_greedy(model, p, 8) for p in ids]
