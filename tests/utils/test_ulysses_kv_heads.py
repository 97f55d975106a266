"""Ulysses with several key/value heads and SP = 4 (issue 43 item 12): which heads each rank attends with.

tests/utils/test_ulysses.py runs two gloo ranks with 1 key/value head (slow, ~100 s of start-up), where
repeating the key/value heads with `repeat` or `repeat_interleave` agrees and two query heads per rank
hide some head orders. Here, in the default suite, the ranks of an SP group are threads of this process
exchanging through a fake all-to-all / all-gather with torch.distributed's semantics (`_Ranks`): every
line of verl/utils/ulysses.py runs as is, on 8 query heads over 2 key/value heads (Qwen2.5-3B's 16/2
ratio halved) at SP = 2 and SP = 4, against SP = 1. The same model at SP = 4 over four real gloo ranks:
the slow test at the end, which also checks the gradients.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.conftest import run_ranks
from tests.workers._batches import free_port
from verl.utils import ulysses

HEADS, KV_HEADS = 8, 2


class _Ranks:
    """`size` simulated SP ranks, one thread each, and the collectives ulysses.py calls (as `dist` and
    `dist_fn`): all_to_all_single (dim 0 of the input: the destination rank; of the output: the source)
    and all_gather, both through shared slots between two barrier waits."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=120)
        self._slots: list[Any] = [None] * size
        self._local = threading.local()

    # torch.distributed's part
    def get_world_size(self, group: Any = None) -> int:
        return self.size

    def get_rank(self, group: Any = None) -> int:
        return self._local.rank

    def _exchange(self, value: Any) -> list[Any]:
        self._slots[self._local.rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()     # every rank has read the slots before any writes the next exchange
        return everyone

    # torch.distributed.nn.functional's part
    def all_to_all_single(self, output: torch.Tensor, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        assert x.shape[0] == self.size and output.shape == x.shape
        everyone = self._exchange(x.clone())
        return torch.stack([everyone[src][self._local.rank] for src in range(self.size)])

    def all_gather(self, x: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
        return tuple(self._exchange(x.clone()))

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """work(rank) on every simulated rank at once; the results in rank order (a rank's error raised)."""
        results: list[Any] = [None] * self.size
        errors: list[str] = []

        def main(rank: int) -> None:
            self._local.rank = rank
            try:
                with torch.no_grad():          # grad mode is per thread
                    results[rank] = work(rank)
            except BaseException:  # noqa: BLE001 - reported below, the other ranks released
                errors.append(f"rank {rank}: {traceback.format_exc()}")
                self._barrier.abort()

        threads = [threading.Thread(target=main, args=(rank,), daemon=True) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a simulated rank is still running"
        assert not errors, "\n".join(errors)
        return results


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], _Ranks]:
    """ranks(size): the SP collectives of ulysses.py replaced by `size` simulated ranks."""

    def make(size: int) -> _Ranks:
        sim = _Ranks(size)
        monkeypatch.setattr(ulysses, "dist", SimpleNamespace(get_world_size=sim.get_world_size,
                                                             get_rank=sim.get_rank))
        monkeypatch.setattr(ulysses, "dist_fn", SimpleNamespace(all_to_all_single=sim.all_to_all_single,
                                                                all_gather=sim.all_gather))
        return sim

    return make


def _labelled(heads: int, tokens: int, first_token: int) -> torch.Tensor:
    """(1, heads, tokens, 2): [..., 0] the head's index, [..., 1] the token's index in the whole row."""
    head = torch.arange(heads, dtype=torch.float32)[:, None].expand(heads, tokens)
    token = torch.arange(first_token, first_token + tokens, dtype=torch.float32)[None].expand(heads, tokens)
    return torch.stack([head, token], dim=-1)[None]


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_attends_its_query_heads_with_the_key_value_head_they_share(ranks, size):
    """8 query heads over 2 key/value heads (query head h reads key/value head h // 4): at SP = 4 each
    key/value head is repeated twice and rank r, holding query heads 2r and 2r + 1, must get key/value
    head r // 2 (`repeat` would hand rank 1 head 1); at SP = 2 rank r gets query heads 4r..4r+3 and
    key/value head r. Every rank gets every token, in order."""
    sim, n = ranks(size), 3
    state = ulysses._SPState(group=None, size=size, full_position_ids=torch.zeros(1, size * n, dtype=torch.long))

    def swap(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        query = ulysses.heads_to_sequence(_labelled(HEADS, n, rank * n), state)
        key = ulysses.heads_to_sequence(_labelled(KV_HEADS, n, rank * n), state)
        return query, key

    for rank, (query, key) in enumerate(sim.run(swap)):
        mine = list(range(rank * HEADS // size, (rank + 1) * HEADS // size))
        assert query.shape == (1, len(mine), size * n, 2)
        assert query[0, :, 0, 0].tolist() == mine
        shared = sorted({h // (HEADS // KV_HEADS) for h in mine})
        assert key.shape[1] == len(shared) and key[0, :, 0, 0].tolist() == shared, (rank, key[0, :, 0, 0])
        for swapped in (query, key):
            assert (swapped[0, :, :, 1] == torch.arange(size * n, dtype=torch.float32)).all()


@pytest.mark.parametrize("size", [2, 4])
def test_the_attention_output_comes_back_to_its_tokens_in_head_order(ranks, size):
    """The return all-to-all: rank r's output of heads r*H/P.. for every token -> every head, in order,
    of rank r's tokens (with two heads per rank or more, an interleaved order would mix them up)."""
    sim, n = ranks(size), 3
    state = ulysses._SPState(group=None, size=size, full_position_ids=torch.zeros(1, size * n, dtype=torch.long))
    share = HEADS // size

    def back(rank: int) -> torch.Tensor:
        out = _labelled(HEADS, size * n, 0)[:, rank * share:(rank + 1) * share]   # (1, H/P, P*n, 2)
        return ulysses.sequence_to_heads(out.transpose(1, 2), state)             # attention's (1, P*n, H/P, D)

    for rank, mine in enumerate(sim.run(back)):
        assert mine.shape == (1, n, HEADS, 2)
        assert (mine[0, :, :, 0] == torch.arange(HEADS, dtype=torch.float32)).all(), (rank, mine[0, 0, :, 0])
        assert mine[0, :, 0, 1].tolist() == list(range(rank * n, (rank + 1) * n))


def _model(kv_heads: int = KV_HEADS) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils.attention import PACKED_ATTENTION, attn_implementation

    attn_implementation("cpu", True)   # registers the packed attention
    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=128)
    config._attn_implementation = PACKED_ATTENTION
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three sequences of 7, 12 and 6 tokens (25: SP = 2 pads one token, SP = 4 three); ids, positions,
    the next-token labels."""
    g = torch.Generator().manual_seed(3)
    lengths = [7, 12, 6]
    ids = torch.randint(1, 101, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions, torch.roll(ids[0], -1)


def _token_log_probs(logits_1nV: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_1nV[0].float(), dim=-1).gather(-1, labels_n[:, None]).squeeze(-1)


def _sp_log_probs(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
                  group: Any, rank: int) -> torch.Tensor:
    """One SP rank's forward (the caller is inside `sequence_parallel`): its slice, the gathered row."""
    ids_n, pos_n, pad = ulysses.slice_packed(ids, positions, group)
    logits = model(input_ids=ids_n, position_ids=pos_n, attention_mask=None, use_cache=False).logits
    labels_padded = torch.cat([labels, labels.new_zeros(pad)])
    chunk = ids_n.shape[1]
    local = _token_log_probs(logits, labels_padded[rank * chunk:(rank + 1) * chunk])
    return ulysses.gather_tokens(local, group)[:ids.shape[1]]


@pytest.mark.parametrize("size", [2, 4])
def test_sp_log_probs_with_two_key_value_heads_equal_sp1(ranks, size):
    """The model (8 heads, 2 key/value heads) on one packed row: every simulated rank's gathered
    log-probs equal the unsplit forward's. A rank attending with the wrong key/value head (SP = 4) or
    an output head put back in the wrong place (either size) moves them by > 1e-2."""
    model = _model()
    ids, positions, labels = _packed_row()
    with torch.no_grad():
        reference = _token_log_probs(model(input_ids=ids, position_ids=positions, attention_mask=None,
                                           use_cache=False).logits, labels)
    sim = ranks(size)
    with ulysses.sequence_parallel(None, positions):     # entered once: the state is module-global
        gathered = sim.run(lambda rank: _sp_log_probs(model, ids, positions, labels, None, rank))
    for rank, log_probs in enumerate(gathered):
        # fp32, the same sums in another order: ~1e-6
        torch.testing.assert_close(log_probs, reference, atol=1e-5, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}")


# ----------------------------------------------------------------------------- four real gloo ranks

def _four_rank_core(rank: int, port: int, result_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=4)
        ids, positions, labels = _packed_row()
        weights = torch.randn(ids.shape[1], generator=torch.Generator().manual_seed(4))
        reference = _model().train()
        logp_ref = _token_log_probs(reference(input_ids=ids, position_ids=positions, attention_mask=None,
                                              use_cache=False).logits, labels)
        (logp_ref * weights).sum().backward()
        model, group = _model().train(), dist.group.WORLD
        with ulysses.sequence_parallel(group, positions) as state:
            logp = _sp_log_probs(model, ids, positions, labels, group, rank)
        with ulysses.resumed(state):
            (logp * weights).sum().backward()     # the same loss on every rank
        torch.testing.assert_close(logp, logp_ref.detach(), atol=1e-5, rtol=0)
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grad /= 4                             # FSDP's mean over the ranks
            scale = float(ref.grad.abs().max())
            torch.testing.assert_close(grad, ref.grad, atol=1e-6 + 1e-4 * scale, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow   # four spawned ranks importing transformers: 207 s on a busy 2-core machine
def test_four_gloo_ranks_with_two_key_value_heads_equal_sp1(tmp_path):
    """The model above at SP = 4 over four real gloo ranks (each key/value head on two ranks): the
    log-probs and the gradients (all-reduced, / 4) of SP = 1."""
    port = free_port()
    run_ranks(_four_rank_core, lambda r: (r, port, str(tmp_path)), tmp_path, world=4, timeout=400)
