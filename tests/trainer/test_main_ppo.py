"""End to end through `run_ppo`: real Ray workers (FSDP on gloo, HF rollout) on a toy single-turn task."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from scripts.bench.toy_task import TOY_DATA_SOURCE, ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.trainer.ppo.checkpointing import LATEST_FILE


def _run(tiny_model_dir: str, tmp_path: Path, adv: str, extra: list[str],
         val_before_train: bool = False, n_agent: int = 2, n_workers: int = 2) -> tuple[list[dict], Path]:
    """One run of the toy task; `n_workers=1` where the test is not about the batch split over workers
    (a second worker process is ~9 s of CPU: its imports, model and gloo group)."""
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    ckpt = tmp_path / "ckpt"
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(ckpt), adv_estimator=adv,
                                       val_before_train=val_before_train, n_agent=n_agent, n_workers=n_workers) + extra)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    return history, ckpt


def _finite(metrics: dict, prefix: str) -> list[str]:
    keys = [k for k in metrics if k.startswith(prefix)]
    assert keys, f"no metric starting with {prefix}"
    assert all(math.isfinite(metrics[k]) for k in keys), {k: metrics[k] for k in keys}
    return keys


def test_one_ppo_step_trains_actor_and_critic_and_saves_a_checkpoint(
        ray_cluster, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import verl.utils.flops_counter

    def driver_device(*args, **kwargs):
        raise AssertionError("the MFU denominator was taken from the driver's device, not the workers'")

    monkeypatch.setattr(verl.utils.flops_counter, "get_device_peak_flops", driver_device)
    history, ckpt = _run(tiny_model_dir, tmp_path, "gae", ["trainer.save_freq=1", "trainer.save_hf_model=true"])
    assert [h["step"] for h in history] == [1]
    step = history[0]
    for prefix in ("critic/score/", "critic/rewards/", "critic/advantages/", "critic/returns/", "critic/values/",
                   "critic/vf_loss", "actor/pg_loss", "actor/reward_kl_penalty", "response_length/",
                   "prompt_length/", "timing_s/", "timing_per_token_ms/", "perf/throughput"):
        _finite(step, prefix)
    for stage in ("gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                  "save_checkpoint", "step"):
        assert step[f"timing_s/{stage}"] > 0
    assert step["response_length/max"] <= 8
    assert step["perf/mfu/actor"] > 0
    assert step["perf/step_wall_s"] > 0 and 0 < step["perf/host_cpu_util"] <= 1
    # The HF engine's sampling log-probs vs the actor's recomputation: same fp32 weights, cached vs
    # packed forward, so rounding only (~1e-6); 1e-3 catches a wrong temperature or position.
    assert 0 <= step["rollout/log_prob_gap_max"] < 1e-3
    # GAE advantages are whitened over the response mask
    assert abs(step["critic/advantages/mean"]) < 1e-4
    assert (ckpt / LATEST_FILE).read_text().strip() == "1"
    assert (ckpt / "global_step_1" / "data.pt").is_file()
    assert (ckpt / "global_step_1" / "critic").is_dir()
    assert (ckpt / "global_step_1" / "hf" / "config.json").is_file()
    assert not list(ckpt.glob("*.tmp"))
    records = [json.loads(line) for line in (ckpt / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]


def test_run_ppo_resolves_the_config_so_the_critic_mini_batch_is_divided_once(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    # 4 prompts x 2 samples = 8 rollouts, mini-batches of 4 rollouts: 2 optimizer steps per update,
    # i.e. 2 rows per worker per step on 2 workers. The critic's mini-batch stays an interpolation
    # (critic.ppo_mini_batch_size -> the actor's); its forward micro-batch is null (= its update's).
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="gae") + [
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
        "critic.ppo_micro_batch_size=2"])
    assert OmegaConf.is_interpolation(cfg.critic, "ppo_mini_batch_size")
    assert cfg.critic.forward_micro_batch_size is None
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (step,) = run_ppo(cfg, reward_fn=ContainsTokenReward(tok))
    # Divided twice, the critic's per-worker mini-batch would be 1 row: 4 steps (or a start-up error).
    assert step["critic/optimizer_steps"] == 2
    assert step["actor/optimizer_steps"] == 2
    assert cfg.critic.ppo_mini_batch_size == 4   # the driver's config: resolved, global sizes


def test_workers_receive_resolved_configs_that_divide_independently(tiny_model_dir: str, tmp_path: Path) -> None:
    import pickle

    from verl.trainer.config_schema import interpolations
    from verl.trainer.main_ppo import build_trainer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager
    from verl.workers.fsdp_workers import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    overrides = toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="gae") + [
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
        "critic.ppo_micro_batch_size=2"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    unresolved = compose_config(overrides)
    trainer = RayPPOTrainer(unresolved, tok, {}, ResourcePoolManager({}, {}), reward_fn=ContainsTokenReward(tok))
    with pytest.raises(ValueError, match="interpolations"):
        trainer.worker_configs()

    trainer = build_trainer(compose_config(overrides), reward_fn=ContainsTokenReward(tok))
    configs = trainer.worker_configs()
    assert set(configs) == {"actor_rollout", "critic"}
    assert all(interpolations(node) == [] for node in configs.values())
    # A colocated worker unpickles both sub-trees together, then each divides its own in place.
    actor, critic = pickle.loads(pickle.dumps((configs["actor_rollout"], configs["critic"])))
    normalize_actor_batch_sizes(actor, "actor_rollout_ref", world_size=2)
    normalize_critic_batch_sizes(critic, world_size=2)
    assert (actor.actor.ppo_mini_batch_size, critic.ppo_mini_batch_size) == (2, 2)
    assert (critic.ppo_micro_batch_size, critic.forward_micro_batch_size) == (1, 1)


def test_one_grpo_step_uses_kl_loss_and_validates_greedily_per_data_source(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    history, ckpt = _run(tiny_model_dir, tmp_path, "grpo",
                         ["trainer.test_freq=1"], val_before_train=True, n_agent=3)
    before, step = history
    assert before["step"] == 0 and set(before) == {"step", f"val/test_score/{TOY_DATA_SOURCE}",
                                                   f"val-core/{TOY_DATA_SOURCE}/reward/mean@1"}
    assert step["step"] == 1
    _finite(step, "actor/kl_loss")
    assert not any(k.startswith("critic/values") for k in step)
    assert "timing_s/values" not in step and "actor/reward_kl_penalty" not in step
    # greedy validation of the same weights gives the same score (before vs after is not
    # comparable, but it must be a mean of 0/1 rewards over the 3 validation rows)
    assert step[f"val/test_score/{TOY_DATA_SOURCE}"] * 3 == pytest.approx(round(step[f"val/test_score/{TOY_DATA_SOURCE}"] * 3))
    assert not (ckpt / LATEST_FILE).exists()


def test_grpo_with_search_masks_observations_and_reports_env_metrics(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # The server passes the start-up probe but fails every search: any search the random model makes
    # must be counted as a failed search, and with retriever.max_failure_fraction=1.0 the run goes on.
    with fake_search_server(retrieve_status=503) as server:
        history, _ = _run(tiny_model_dir, tmp_path, "grpo",
                          ["do_search=true", "max_turns=1", "actor_rollout_ref.actor.state_masking=true",
                           "data.max_prompt_length=512", f"retriever.url={server['url']}/retrieve",
                           "retriever.max_failure_fraction=1.0", "retriever.max_retries=0",
                           "data.max_obs_length=160"], val_before_train=True, n_workers=1)
    val, step = history
    assert val["step"] == 0 and f"val/test_score/{TOY_DATA_SOURCE}" in val
    assert 1 <= val["val/env/number_of_actions/min"] <= val["val/env/number_of_actions/max"] <= 2
    assert step["step"] == 1
    assert 1 <= step["env/number_of_actions/min"] <= step["env/number_of_actions/max"] <= 2
    for key in ("env/finish_ratio", "env/number_of_valid_action", "env/ratio_of_valid_action",
                "env/number_of_valid_search", "env/search_failures", "env/obs_truncated",
                "env/search_failure_fraction"):
        assert math.isfinite(step[key]), key
    # every search the policy made failed (and was counted)
    assert step["env/search_failure_fraction"] == (1.0 if step["env/number_of_valid_search"] > 0 else 0.0)
    # every row that did not answer got an observation (invalid-action / budget notice): masked tokens
    if step["env/finish_ratio"] > 0:
        assert step["state_tokens/total"] > 0
    assert 0.0 <= step["state_tokens/coverage"] < 1.0
    _finite(step, "actor/kl_loss")


def test_unknown_data_source_fails_before_any_worker_starts(tiny_model_dir: str, tmp_path: Path) -> None:
    import ray

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt")))
    was_running = ray.is_initialized()
    with pytest.raises(ValueError, match=TOY_DATA_SOURCE):
        run_ppo(cfg)   # the rule reward has no scorer for the toy source
    assert ray.is_initialized() == was_running


# --------------------------------------------------------------------------- driver logic, scripted workers
class ScriptedActorRollout:
    """Stands in for the actor/rollout worker group: replays fixed responses, records what it was sent."""

    def __init__(self, response_ids: list[int], pad_id: int) -> None:
        self.response_ids = response_ids
        self.pad_id = pad_id
        self.generate_calls: list = []
        self.updates: list = []

    def generate_sequences(self, prompts):
        import torch

        from verl.protocol import DataProto

        self.generate_calls.append(prompts)
        n = len(prompts)
        responses = torch.tensor([self.response_ids] * n)
        attn = torch.cat([prompts.batch["attention_mask"], torch.ones_like(responses)], dim=1)
        return DataProto.from_dict({
            "prompts": prompts.batch["input_ids"], "responses": responses,
            "input_ids": torch.cat([prompts.batch["input_ids"], responses], dim=1), "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)})

    def rollout_wake_up(self, seed: int | None = None) -> None:
        """No engine to wake (the trainer wakes the workers' engines once per rollout)."""

    def rollout_sleep(self) -> list:
        return [None]        # one worker, which did not count its wake-ups

    def compute_log_prob(self, data):
        import torch

        from verl.protocol import DataProto

        return DataProto.from_dict({"old_log_probs": torch.zeros(data.batch["responses"].shape)})

    def compute_ref_log_prob(self, data):
        import torch

        from verl.protocol import DataProto

        return DataProto.from_dict({"ref_log_prob": torch.zeros(data.batch["responses"].shape)})

    def update_actor(self, data):
        from verl.protocol import DataProto

        self.updates.append(data)
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [0.5, 1.5]}})


def _scripted_trainer(tiny_model_dir: str, tmp_path: Path, n_val: int = 3, n_agent: int = 2,
                      extra: tuple[str, ...] = ()):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=n_val)
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="grpo",
                                       n_agent=n_agent, batch_size=4) + list(extra))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    target = tok.convert_tokens_to_ids("<answer>")
    trainer = RayPPOTrainer(cfg, tok, {}, ResourcePoolManager({}, {}), reward_fn=ContainsTokenReward(tok),
                            val_reward_fn=ContainsTokenReward(tok))
    trainer.actor_rollout_wg = ScriptedActorRollout([target, 5, 6, tok.eos_token_id], tok.pad_token_id)
    return trainer


def test_grpo_groups_are_per_prompt_uids_shared_by_the_n_agent_samples(tiny_model_dir: str, tmp_path: Path) -> None:
    trainer = _scripted_trainer(tiny_model_dir, tmp_path)
    metrics = trainer.train_step(next(iter(trainer.train_dataloader)))
    batch = trainer.actor_rollout_wg.updates[0]
    uids = batch.non_tensor_batch["uid"].tolist()
    index = batch.non_tensor_batch["index"].tolist()
    assert len(uids) == 8 and len(set(uids)) == 4
    for uid in set(uids):  # each group = the 2 samples of one prompt
        rows = [i for i, u in enumerate(uids) if u == uid]
        assert len(rows) == 2 and len({index[i] for i in rows}) == 1
    # training samples, the update's metrics are reduced to their mean, the score is 1 everywhere
    assert all(c.meta_info["do_sample"] is True for c in trainer.actor_rollout_wg.generate_calls)
    # Exact: the mean of values that are all exactly 1.0 is exactly 1.0 on any CPU.
    assert metrics["actor/pg_loss"] == 1.0
    assert metrics["critic/score/mean"] == 1.0
    assert batch.batch["response_mask"].tolist() == [[1, 1, 1, 1]] * 8


def test_validation_is_greedy_and_scores_every_row(tiny_model_dir: str, tmp_path: Path) -> None:
    trainer = _scripted_trainer(tiny_model_dir, tmp_path, n_val=7)   # 7 rows, batch 4: 4 + 3
    val = trainer._validate()
    calls = trainer.actor_rollout_wg.generate_calls
    assert [len(c) for c in calls] == [4, 3]
    assert all(c.meta_info["do_sample"] is False for c in calls)
    assert val == {f"val/test_score/{TOY_DATA_SOURCE}": 1.0, f"val-core/{TOY_DATA_SOURCE}/reward/mean@1": 1.0}
    assert trainer._validate() == val


def test_total_training_steps_reach_the_optimizer_configs_before_workers_exist(
        tiny_model_dir: str, tmp_path: Path) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager

    paths = write_toy_parquets(tmp_path / "data", n_train=10, n_val=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for cap, epochs, expected in (("null", 3, 6), ("4", 3, 4), ("100", 1, 2)):   # 10 rows // batch 4 = 2 a epoch
        cfg = compose_config([*toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt")),
                              f"trainer.total_training_steps={cap}", f"trainer.total_epochs={epochs}"])
        trainer = RayPPOTrainer(cfg, tok, {}, ResourcePoolManager({}, {}), reward_fn=ContainsTokenReward(tok))
        assert trainer.total_training_steps == expected
        assert cfg.actor_rollout_ref.actor.optim.total_training_steps == expected
        assert cfg.critic.optim.total_training_steps == expected


@pytest.mark.parametrize(("critic_warmup", "updated_steps"), [(0, [1, 2]), (1, [1, 2]), (2, [2])])
def test_critic_warmup_counts_steps_from_one_as_verl(tiny_model_dir: str, tmp_path: Path, critic_warmup: int,
                                                      updated_steps: list[int]) -> None:
    trainer = _scripted_trainer(tiny_model_dir, tmp_path, extra=(f"trainer.critic_warmup={critic_warmup}",))
    updated = []
    for batch in trainer.train_dataloader:      # 8 prompts, batch 4: two steps
        before = len(trainer.actor_rollout_wg.updates)
        trainer.train_step(batch)
        if len(trainer.actor_rollout_wg.updates) > before:
            updated.append(trainer.global_step)
    assert trainer.global_step == 2
    assert updated == updated_steps


def test_rollout_n_repeats_prompts_like_n_agent_and_the_group_holds_all_samples(
        tiny_model_dir: str, tmp_path: Path) -> None:
    trainer = _scripted_trainer(tiny_model_dir, tmp_path, n_agent=2, extra=("actor_rollout_ref.rollout.n=2",))
    trainer.train_step(next(iter(trainer.train_dataloader)))
    uids = trainer.actor_rollout_wg.updates[0].non_tensor_batch["uid"].tolist()
    assert len(uids) == 4 * 2 * 2 and len(set(uids)) == 4
    assert all(uids.count(uid) == 4 for uid in set(uids))


class ScriptedSearchActorRollout(ScriptedActorRollout):
    """ScriptedActorRollout whose generation replays per-prompt multi-turn streams (scripts/bench/rollout.py)."""

    def __init__(self, tokenizer, scripts: dict[str, list[list[int]]]) -> None:
        from scripts.bench.rollout import ScriptedRollout

        super().__init__([], tokenizer.pad_token_id)
        self.engine = ScriptedRollout(tokenizer, scripts, key_pattern=r"Question (\S+?)\?")

    def generate_sequences(self, prompts):
        self.generate_calls.append(prompts)
        return self.engine.generate_sequences(prompts)


def test_tokens_sampled_after_the_rolling_context_dropped_turns_are_kept_out_of_the_update(
        tiny_model_dir: str, tmp_path: Path) -> None:
    from search_r1.llm_agent import actions
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    invalid = tok.encode("<think> I wonder </think> nothing", add_special_tokens=False)
    notice = len(tok.encode(actions.INVALID_ACTION_NOTICE, add_special_tokens=False))
    turn_len = len(invalid) + notice
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    overrides = toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="grpo", n_agent=2,
                              batch_size=4, response_length=len(invalid)) + [
        "do_search=true", "max_turns=2", "actor_rollout_ref.actor.state_masking=true",
        "retriever.url=http://127.0.0.1:9/retrieve", f"data.max_obs_length={notice + 8}",
        # Room for the prompt (<= 32 tokens) and one turn, not two: the final turn's context is cut.
        f"data.max_prompt_length={32 + turn_len + 1}"]
    trainer = RayPPOTrainer(compose_config(overrides), tok, {}, ResourcePoolManager({}, {}),
                            reward_fn=ContainsTokenReward(tok))
    trainer.actor_rollout_wg = ScriptedSearchActorRollout(tok, {str(i): [invalid] * 3 for i in range(8)})
    metrics = trainer.train_step(next(iter(trainer.train_dataloader)))

    batch = trainer.actor_rollout_wg.updates[0].batch
    assert metrics["env/context_cuts"] == 8                 # every row's final (third) turn
    cut, loss_mask, response_mask = batch["context_cut_mask"], batch["loss_mask"], batch["response_mask"]
    final_turn = slice(2 * turn_len, 2 * turn_len + len(invalid))
    assert cut[:, final_turn].eq(1).all() and cut.sum() == 8 * len(invalid)
    assert loss_mask[:, final_turn].eq(1).all()             # the reward still reads the final turn's text
    assert torch.equal(response_mask, loss_mask * (1 - cut))
    assert response_mask[:, : 2 * turn_len].sum() == 8 * 2 * len(invalid)  # earlier turns still train
    assert metrics["env/context_cut_masked_tokens"] == 8 * len(invalid)


def test_gpu_or_cpu_is_decided_by_the_ray_cluster_not_the_driver(tmp_path: Path) -> None:
    """A CPU-only head node driving a GPU cluster must train on the GPUs: a real local Ray cluster
    that declares two (logical) GPUs, on this GPU-less machine."""
    import subprocess
    import sys

    code = (
        "import ray, torch\n"
        "from verl.trainer.main_ppo import _has_gpu, compose_config\n"
        "assert not torch.cuda.is_available()\n"
        "ray.init(num_cpus=1, num_gpus=2, include_dashboard=False)\n"
        "print('auto', _has_gpu(compose_config([])))\n"
        "print('cpu', _has_gpu(compose_config(['trainer.device=cpu'])))\n"
        "ray.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "auto True" in proc.stdout and "cpu False" in proc.stdout


# --------------------------------------------------------------------------- the retrieval server: probe and failures
@contextmanager
def fake_search_server(health: str = "ok", retrieve_status: int = 200, unhealthy_first: int = 0) -> Iterator[dict]:
    """A stand-in retrieval server on 127.0.0.1: `health` is "ok" (GET /health answers 200 after
    `unhealthy_first` 503s, as a server still loading its index) or "none" (no /health route, like
    the original Search-R1 server); POST /retrieve answers `retrieve_status` (one hit per query when
    200). Yields {"url": <base url>, "health_calls": n, "retrieve_calls": n}."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from search_r1.search.serving import serve_in_background

    app = FastAPI()
    state: dict = {"health_calls": 0, "retrieve_calls": 0}
    if health == "ok":
        @app.get("/health")
        def _health():
            state["health_calls"] += 1
            if state["health_calls"] <= unhealthy_first:
                return JSONResponse({"status": "loading"}, status_code=503)
            return JSONResponse({"status": "ok"})

    @app.post("/retrieve")
    def _retrieve(body: dict):
        state["retrieve_calls"] += 1
        if retrieve_status != 200:
            return JSONResponse({"detail": "index unavailable"}, status_code=retrieve_status)
        hit = {"document": {"id": "0", "contents": '"Title"\ntext'}, "score": 1.0}
        return JSONResponse({"result": [[hit] for _ in body["queries"]]})

    with serve_in_background(app) as url:
        state["url"] = url
        yield state


def _search_cfg(tiny_model_dir: str, tmp_path: Path, url: str, extra: tuple[str, ...] = ()):
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    return compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt")) + [
        "do_search=true", "max_turns=1", f"retriever.url={url}", "data.max_prompt_length=256",
        "data.max_obs_length=128", *extra])


def test_the_probe_waits_for_a_server_that_is_still_loading(tiny_model_dir: str, tmp_path: Path) -> None:
    from verl.trainer.main_ppo import wait_for_retriever

    with fake_search_server(unhealthy_first=2) as server:
        cfg = _search_cfg(tiny_model_dir, tmp_path, f"{server['url']}/retrieve", ("retriever.health_wait_s=60",))
        assert wait_for_retriever(cfg) == f"{server['url']}/health"
        assert server["health_calls"] == 3 and server["retrieve_calls"] == 0


def test_the_probe_accepts_a_server_without_health_that_answers_retrieve(tiny_model_dir: str, tmp_path: Path) -> None:
    from verl.trainer.main_ppo import wait_for_retriever

    with fake_search_server(health="none") as server:
        cfg = _search_cfg(tiny_model_dir, tmp_path, f"{server['url']}/retrieve", ("retriever.health_wait_s=10",))
        assert wait_for_retriever(cfg) == f"{server['url']}/retrieve"
        assert server["retrieve_calls"] == 1


@pytest.mark.parametrize("listener", ["nothing", "silent"])
def test_a_url_that_never_answers_fails_the_probe_before_any_worker_starts(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listener: str) -> None:
    import socket
    import time

    from verl.trainer import main_ppo

    def must_not_run(*args, **kwargs):
        raise AssertionError("the run went on past a retrieval server that never answered")

    monkeypatch.setattr(main_ppo, "build_trainer", must_not_run)
    monkeypatch.setattr(main_ppo, "_init_ray", must_not_run)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        if listener == "silent":
            sock.listen(8)          # connections are queued, never accepted: a request waits for an answer
        port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}/retrieve"
        cfg = _search_cfg(tiny_model_dir, tmp_path, url, ("retriever.health_wait_s=3",))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            run_ppo(cfg)
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"retriever.url={url}" in message and f"GET http://127.0.0.1:{port}/health" in message
    assert "retriever.health_wait_s=3" in message and "No worker was started" in message
    assert elapsed < 60, elapsed    # a bounded wait (3 s + one request timeout), not the 600 s default


def test_search_failure_fraction_counts_failed_searches_over_all_searches() -> None:
    from verl.trainer.ppo.metric_utils import compute_env_metrics

    metrics = compute_env_metrics({"search_failures": 3, "valid_search_stats": [2, 1, 1, 0]})
    assert (metrics["env/search_failures"], metrics["env/search_failure_fraction"]) == (3.0, 0.75)
    assert compute_env_metrics({"search_failures": 0, "valid_search_stats": [0, 0]})["env/search_failure_fraction"] == 0.0
    assert "env/search_failure_fraction" not in compute_env_metrics({})


def test_check_search_failures_stops_above_the_limit_only() -> None:
    from verl.trainer.ppo.rollout_setup import SearchFailureError, check_search_failures

    cfg = compose_config(["retriever.url=http://10.0.0.9:8000/retrieve"])
    assert cfg.retriever.max_failure_fraction == 0.05   # the default: 1 search in 20 may fail (after retries)
    check_search_failures({"env/search_failure_fraction": 0.05}, cfg, "x")         # at the limit: goes on
    check_search_failures({}, cfg, "x")                                            # no search, nothing to check
    with pytest.raises(SearchFailureError, match=r"=0\.062 .* exceeds retriever.max_failure_fraction=0\.05"):
        check_search_failures({"env/search_failure_fraction": 1 / 16}, cfg, "x")   # 1 of 16 failed: stops
    with pytest.raises(SearchFailureError) as info:
        check_search_failures({"val/env/search_failure_fraction": 0.75, "val/env/search_failures": 3.0}, cfg,
                              "validation at step 4", "val/env/")
    assert isinstance(info.value, RuntimeError)
    assert str(info.value).startswith("val/env/search_failure_fraction=0.750 (val/env/search_failures=3) in the "
                                      "validation at step 4 exceeds retriever.max_failure_fraction=0.05")
    assert "GET http://10.0.0.9:8000/health" in str(info.value)
    off = compose_config(["retriever.max_failure_fraction=1.0"])
    check_search_failures({"env/search_failure_fraction": 1.0}, off, "x")


def _searching_trainer(tiny_model_dir: str, tmp_path: Path, url: str, extra: tuple[str, ...] = ()):
    """A scripted trainer whose every row searches once, then answers (no Ray, no model)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    search = tok.encode("<think> hm </think><search> lighthouse </search>", add_special_tokens=False)
    answer = tok.encode("<answer> x </answer>", add_special_tokens=False) + [tok.eos_token_id]
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    overrides = toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="grpo", n_agent=2,
                              batch_size=4, response_length=max(len(search), len(answer)) + 2) + [
        "do_search=true", "max_turns=1", "actor_rollout_ref.actor.state_masking=true", f"retriever.url={url}",
        "retriever.max_retries=0", "data.max_obs_length=128", "data.max_prompt_length=256", *extra]
    trainer = RayPPOTrainer(compose_config(overrides), tok, {}, ResourcePoolManager({}, {}),
                            reward_fn=ContainsTokenReward(tok))
    trainer.actor_rollout_wg = ScriptedSearchActorRollout(tok, {str(i): [search, answer] for i in range(8)})
    return trainer


def test_a_rollout_whose_searches_fail_stops_the_run_before_the_update(tiny_model_dir: str, tmp_path: Path) -> None:
    from tests.conftest import free_port
    from verl.trainer.ppo.rollout_setup import SearchFailureError

    port = free_port()         # nothing listens there: every search fails
    trainer = _searching_trainer(tiny_model_dir, tmp_path, f"http://127.0.0.1:{port}/retrieve")
    with pytest.raises(SearchFailureError) as info:
        trainer.train_step(next(iter(trainer.train_dataloader)))
    message = str(info.value)
    assert message.startswith("env/search_failure_fraction=1.000 (env/search_failures=8) in the rollout of "
                              "training step 1 exceeds retriever.max_failure_fraction=0.05")
    assert f"GET http://127.0.0.1:{port}/health" in message
    assert trainer.actor_rollout_wg.updates == []        # nothing was trained on the failure notices


def test_max_failure_fraction_1_trains_on_and_counts_the_failures(tiny_model_dir: str, tmp_path: Path) -> None:
    with fake_search_server(retrieve_status=503) as server:
        trainer = _searching_trainer(tiny_model_dir, tmp_path, f"{server['url']}/retrieve",
                                     ("retriever.max_failure_fraction=1.0",))
        metrics = trainer.train_step(next(iter(trainer.train_dataloader)))
    assert (metrics["env/search_failures"], metrics["env/search_failure_fraction"]) == (8.0, 1.0)
    assert metrics["env/number_of_valid_search"] == 1.0
    assert len(trainer.actor_rollout_wg.updates) == 1


def test_one_grpo_step_with_rollout_correction_reports_weights_near_one(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # The HF rollout samples from the policy the actor recomputes: pi_old / pi_rollout ~ 1, so token
    # weights average ~1, none is truncated at 2, and a generous rejection band rejects nothing.
    history, _ = _run(tiny_model_dir, tmp_path, "grpo", [
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=sequence",
        "algorithm.rollout_correction.rollout_rs_threshold=100", "algorithm.rollout_correction.rollout_token_veto_threshold=1e-6"],
        n_workers=1)
    (step,) = history
    _finite(step, "rollout_corr/")
    assert step["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert step["rollout_corr/is_truncated_frac"] == 0.0 and step["rollout_corr/rejected_seq_frac"] == 0.0
    assert step["rollout_corr/is_ess"] == pytest.approx(1.0, abs=1e-3)
    _finite(step, "actor/pg_loss")
