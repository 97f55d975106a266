"""RolloutCounters counts what a rollout costs on a GPU with nothing but a CPU: forwards by kind and
rows, host syncs and torch ops of the watched calls (inside or outside the forward), in any thread."""

from __future__ import annotations

import threading

import torch
from torch import nn

from verl.workers.rollout.counters import RolloutCounters, ops_inside


class _TinyLM(nn.Module):
    """A forward that reads one value on the host (as some HF mask code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        hidden = self.proj(torch.ones(*input_ids.shape, 4))
        bool(attention_mask.all())
        return hidden


class _Engine:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def step(self, rows: int) -> list[int]:
        ids = torch.ones(rows, 3, dtype=torch.long)
        self.model(input_ids=ids, attention_mask=torch.ones(rows, 3, dtype=torch.long))        # prefill
        self.model(input_ids=ids[:, :1], attention_mask=torch.ones(rows, 4, dtype=torch.long), past_key_values=())
        tokens = torch.arange(rows) * 2
        tokens.to("cpu", non_blocking=True)      # a non-blocking copy does not wait for the stream
        tokens.to("cpu")                         # a blocking one from host memory does (on CUDA)
        int(tokens[0])
        return tokens.tolist()


def test_forwards_syncs_and_ops_of_watched_calls_are_counted_by_kind():
    model = _TinyLM()
    engine = _Engine(model)
    with RolloutCounters(model) as counts:
        engine.step(3)                           # not watched: forwards only
        counts.watch(engine, "step")
        engine.step(5)
        torch.ones(2).tolist()                   # the caller's own work: not counted
    assert (counts.prefill_forwards, counts.decode_forwards) == (2, 2)
    assert (counts.prefill_rows, counts.decode_rows, counts.prefill_tokens) == (8, 8, 24)
    assert counts.host_syncs_in_forward == 2                    # the watched call's two forwards
    assert dict(counts.sync_names) == {"to(host->device)": 1, "__int__": 1, "tolist": 1}
    assert counts.ops_in_forward > 0 and counts.op_names["mul"] == 1
    assert "step" not in vars(engine)            # the class's method again
    summary = counts.summary(generated_tokens=4)
    assert summary["forwards_per_generated_token"] == 1.0 and summary["host_syncs_per_step"] == 1.5


def test_a_watched_call_in_another_thread_is_counted_there():
    model = _TinyLM()
    engine = _Engine(model)
    with RolloutCounters(model) as counts:
        counts.watch(engine, "step")
        worker = threading.Thread(target=engine.step, args=(2,))
        worker.start()
        worker.join()
    assert counts.host_syncs_outside_forward == 3 and counts.host_syncs_in_forward == 2


def test_one_multinomial_counts_the_ops_its_kernel_runs():
    assert ops_inside("multinomial") >= 10     # aminmax, checks, asserts, the draw, divide, argmax
    assert ops_inside("add") == 1
    with RolloutCounters(_TinyLM()) as counts:
        holder = type("Holder", (), {"draw": staticmethod(lambda p: torch.multinomial(p, 1))})()
        counts.watch(holder, "draw")
        holder.draw(torch.full((3,), 1 / 3))
    assert counts.ops_outside_forward == ops_inside("multinomial")
