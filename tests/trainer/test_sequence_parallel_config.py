"""Ulysses sequence parallelism's config: the rules (config_check, preflight, the workers' own checks),
batch sizes over world / SP data-parallel ranks, and the memory plan's 1/SP of the tokens
(verl/workers/sp_groups.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer._preflight_data import write_data
from verl.protocol import DataProto
from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.trainer.preflight import run_preflight
from verl.utils.memory_plan import ModelShape, plan_memory, read_model_config, sequence_length
from verl.workers.fsdp_workers import check_supported, normalize_actor_batch_sizes
from verl.workers.sp_groups import SPGroups

CONFIGS = Path(__file__).resolve().parents[2] / "example" / "model_configs"
QWEN_7B = str(CONFIGS / "qwen2.5-7b")     # 28 attention heads, 4 key/value heads
SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
PACK = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
# 8 workers, per-GPU micro-batches: 1 row per data-parallel rank whatever the SP size
EIGHT = ["trainer.n_gpus_per_node=8", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "trainer.logger=[console]", "do_search=false",
         f"actor_rollout_ref.model.path={QWEN_7B}", f"critic.model.path={QWEN_7B}"]


def _errors(*extra: str) -> list[str]:
    cfg = compose_config([*EIGHT, *extra])
    OmegaConf.resolve(cfg)
    return config_errors(cfg, has_gpu=False)


def test_sp_needs_packing_and_a_size_that_divides_the_world() -> None:
    assert _errors(f"{SP}=2", "critic.ulysses_sequence_parallel_size=4", *PACK) == []
    unpacked = _errors(f"{SP}=2")
    assert any(f"{SP}=2 splits packed rows: set actor_rollout_ref.model.use_remove_padding=true" in e
               for e in unpacked), unpacked
    odd = _errors(f"{SP}=3", *PACK)
    assert any(f"{SP}=3 must divide trainer.nnodes*trainer.n_gpus_per_node=8" in e for e in odd), odd
    ref = _errors(f"{SP}=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1", *PACK,
                  "algorithm.use_kl_in_reward=true")
    assert any("actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 must equal" in e for e in ref), ref



def test_sp_with_gradient_checkpointing_composes() -> None:
    # the actor and critic re-enter the forward's SP state around each backward (ulysses.resumed), so
    # the layers gradient checkpointing recomputes run the all-to-alls too (tests/utils/test_ulysses.py)
    assert _errors(f"{SP}=2", *PACK, "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                   "critic.ulysses_sequence_parallel_size=2", "critic.model.enable_gradient_checkpointing=true") == []
    # the other SP rules still hold with it on
    no_pack = _errors(f"{SP}=2", "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    assert any(f"{SP}=2 splits packed rows" in e for e in no_pack), no_pack


def test_micro_batches_split_over_world_over_sp_data_parallel_ranks() -> None:
    cfg = compose_config([*EIGHT, f"{SP}=4", *PACK, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                          "actor_rollout_ref.actor.ppo_micro_batch_size=2"])
    OmegaConf.resolve(cfg)
    # 2 rows over 8 workers would not divide; over 8 / 4 = 2 data-parallel ranks it does
    assert config_errors(cfg, has_gpu=False) == []
    arr = cfg.actor_rollout_ref   # what the worker does with dp = 8 / 4
    normalize_actor_batch_sizes(arr, "actor_rollout_ref", world_size=2)
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size) == (16, 1)
    odd = compose_config([*EIGHT, f"{SP}=4", *PACK, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                          "actor_rollout_ref.actor.ppo_micro_batch_size=1"])
    OmegaConf.resolve(odd)
    errors = config_errors(odd, has_gpu=False)
    assert any("actor_rollout_ref.actor.ppo_micro_batch_size=1 is not divisible by "
               "trainer.nnodes*trainer.n_gpus_per_node/ulysses_sequence_parallel_size=2" in e for e in errors), errors


def test_preflight_refuses_head_counts_the_sp_size_does_not_divide(tmp_path: Path) -> None:
    data = write_data(tmp_path / "data")
    good = run_preflight(compose_config([*EIGHT, *data, f"{SP}=2", *PACK]), has_gpu=False)
    assert good.passed, good.render()
    assert "actor per worker: mini-batch 8 rows" in good.render()     # 32 rollouts over 8 / 2 ranks
    bad = run_preflight(compose_config([*EIGHT, *data, f"{SP}=8", *PACK]), has_gpu=False)
    messages = [e["message"] for e in bad.errors if e["key"] == SP]
    assert any("does not fit the model's attention heads (28) and key/value heads (4)" in m for m in messages), \
        bad.render()
    # Qwen2.5-3B (16 heads, 2 key/value heads) at SP=8: each key/value head repeated 4 times
    qwen_3b = str(CONFIGS / "qwen2.5-3b")
    repeated = run_preflight(compose_config([*EIGHT, *data, f"{SP}=8", *PACK, f"actor_rollout_ref.model.path={qwen_3b}",
                                             f"critic.model.path={qwen_3b}"]), has_gpu=False)
    assert repeated.passed, repeated.render()


def test_the_workers_check_the_model_heads_when_they_start(tiny_model_dir: str) -> None:
    # the tiny Qwen2: 4 heads, 2 key/value heads
    node = OmegaConf.create({"strategy": "fsdp", "ulysses_sequence_parallel_size": 8})
    model = OmegaConf.create({"path": tiny_model_dir, "use_remove_padding": True})
    with pytest.raises(ValueError, match=r"actor\.ulysses_sequence_parallel_size=8 does not fit the model's attention "
                                         r"heads \(4\) and key/value heads \(2\)"):
        check_supported(node, "actor", world_size=8, model_cfg=model)
    node.ulysses_sequence_parallel_size = 4      # the 2 key/value heads repeated twice
    assert check_supported(node, "actor", world_size=4, model_cfg=model) == 4
    node.ulysses_sequence_parallel_size = 2
    assert check_supported(node, "actor", world_size=4, model_cfg=model) == 2
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        check_supported(node, "actor", world_size=4, model_cfg=OmegaConf.create({"path": tiny_model_dir}))
    # a pipelined run's rollout pool trains nothing: no SP there, whatever its world size
    assert check_supported(node, "actor", world_size=3, model_cfg=None, sequence_parallel=False) == 1


def _actor_phases(*extra: str) -> dict:
    cfg = compose_config([*EIGHT, *PACK, *extra])
    OmegaConf.resolve(cfg)
    return {p.name: p for p in plan_memory(cfg).phases}


def test_the_memory_plan_counts_one_sp_share_of_the_tokens() -> None:
    one, two = _actor_phases(), _actor_phases(f"{SP}=2", "critic.ulysses_sequence_parallel_size=2")
    # per-GPU micro-batches of 1 row: each rank of an SP group holds half the row's tokens
    for phase in ("actor_update", "actor_log_prob", "reference_log_prob", "critic_values", "critic_update"):
        a1, a2 = one[phase].estimated["activations"], two[phase].estimated["activations"]
        assert abs(a2 - a1 / 2) <= a1 * 1e-3, (phase, a1, a2)
    # the head: SP=1 runs it on the response positions of the row; under SP on every position of the
    # rank's half (DataParallelPPOActor._head_sequence_parallel labels them all), so per rank on
    # ceil(seq / 2) positions, more than the response's half whenever the prompt is not empty
    cfg = compose_config([*EIGHT, *PACK])
    OmegaConf.resolve(cfg)
    seq = sequence_length(cfg)
    response = one["actor_log_prob"].certain["log-prob head per response token"] // 16   # 1 row's
    assert 0 < response < seq // 2, (response, seq)
    hidden = ModelShape.from_config(read_model_config(QWEN_7B)[0]).hidden_size
    for phase, per_position in (("actor_update", 16 + 4 * hidden), ("actor_log_prob", 16),
                                ("reference_log_prob", 16)):
        assert one[phase].certain["log-prob head per response token"] == response * per_position, phase
        assert two[phase].certain["log-prob head per position of the SP slice"] == -(-seq // 2) * per_position, phase
        assert "log-prob head per response token" not in two[phase].certain
    # a global micro-batch: 8 rows over 8 ranks (1 each) or over 4 SP=2 groups (2 rows, half of each): the same
    glob = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "actor_rollout_ref.actor.ppo_micro_batch_size=8"]
    assert (_actor_phases(*glob)["actor_update"].estimated ==
            _actor_phases(*glob, f"{SP}=2")["actor_update"].estimated)


def test_sp_groups_split_hands_each_rank_its_own_rows() -> None:
    out = DataProto.from_dict(tensors={"x": torch.arange(5)})
    assert SPGroups(1, 0).split(out) is out
    second = SPGroups(2, 1, _lengths=(3, 2))
    assert second.split(out).batch["x"].tolist() == [3, 4]
    with pytest.raises(RuntimeError, match="the last gather brought"):
        SPGroups(2, 0, _lengths=(2, 2)).split(out)
