"""What the vLLM rollout asks of the engine, and in which order, pinned with a recording fake.

These paths only run for real on a GPU (sleep mode, CUDA allocator, device index), so a fake
`vllm` module records every call: the wake order that keeps memory low, one wake per rollout,
the device index the engine starts on, the one EOS set, the abort of a failed call's requests,
and the seeds a tensor-parallel engine's ranks share. No vLLM needed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.workers._batches import load_trainer_config
from verl.protocol import DataProto
from verl.single_controller.base.decorator import MeshRank
from verl.utils import batch_keys as K
from verl.workers.rollout import vllm_rollout
from verl.workers.rollout.vllm_rollout import VLLMStepEngine, engine_args_from, log_probs_mode, vLLMRollout


class FakeParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self.seed = None

    def clone(self) -> FakeParams:
        copy = FakeParams(**self.__dict__)
        copy.seed = self.seed
        return copy


class FakeEngine:
    """LLMEngine: finishes every request at the first step with one sampled token (id 5)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.requests: dict[str, Any] = {}
        self.fail_next_step = False

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} already running")
        self.requests[request_id] = params
        self.last_params = params

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_ids: list[str]) -> None:
        self.log.append(f"abort:{','.join(request_ids)}")
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def step(self) -> list[Any]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("engine step failed")
        done, self.requests = self.requests, {}
        completion = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(request_id=rid, finished=True, outputs=[completion]) for rid in done]


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.local_rank_at_start = os.environ.get("LOCAL_RANK")
        self.log: list[str] = []
        self.llm_engine = FakeEngine(self.log)
        FakeLLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep:{level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.log.append(f"wake_up:{','.join(tags or ['all'])}")

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.loaded = list(kwargs["weights_iterator"])   # consumes the stream, as vLLM's loader does
        self.log.append(method)

    def reset_prefix_cache(self) -> bool:
        self.log.append("reset_prefix_cache")
        return self.prefix_cache_resets

    prefix_cache_resets = True


REAL_IMPORT_VLLM = vllm_rollout.import_vllm


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    module = SimpleNamespace(
        LLM=FakeLLM, SamplingParams=FakeParams,
        sampling_params=SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final_only")))
    monkeypatch.setattr(vllm_rollout, "import_vllm", lambda: module)
    FakeLLM.instances.clear()
    return module


def _rollout_config(**overrides: Any) -> Any:
    cfg = load_trainer_config("/nonexistent/model", **{"data.max_prompt_length": 16,
                                                       "data.max_response_length": 8, **overrides})
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref.rollout


class _Tok:
    eos_token_id, pad_token_id = 1, 0


def _prompts(meta: dict | None = None) -> DataProto:
    ids = torch.tensor([[0, 7, 8], [9, 10, 11]])
    mask = (ids != 0).long()
    return DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                        K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={K.META_EOS_TOKEN_ID: [1, 7], K.META_PAD_TOKEN_ID: 0,
                                          K.META_RESPONSE_LENGTH: 4, **(meta or {})})


def test_waking_frees_memory_before_each_allocation_and_loads_weights_before_the_kv_cache(
        fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m", device="cuda", device_index=0)
    llm = FakeLLM.instances[0]
    assert llm.log == ["sleep:2"]     # asleep from the start: training needs the memory first
    # One list in call order: the engine's calls and the allocator's, interleaved.
    calls: list[str] = []
    llm.log = calls
    monkeypatch.setattr(vllm_rollout.device_utils, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(vllm_rollout.device_utils, "synchronize", lambda: calls.append("synchronize"))
    rollout.wake_up(lambda: rollout.sync_weights([("model.w", torch.zeros(2))], version=1))
    assert calls == ["empty_cache", "wake_up:weights", "reload_weights", "reset_prefix_cache", "synchronize",
                     "empty_cache", "wake_up:kv_cache"]
    calls.clear()
    rollout.sleep()
    # Level 2: no pinned host copy of the weights; the next wake streams the actor's weights in.
    assert calls == ["sleep:2", "empty_cache"] and rollout.synced_version is None
    assert rollout.wake_ups == 1


def test_weights_already_loaded_are_not_streamed_again(fake_vllm: Any) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    assert rollout.sync_weights([("w", torch.zeros(1))], version=3) is True
    assert rollout.sync_weights([("w", torch.zeros(1))], version=3) is False
    assert FakeLLM.instances[0].log.count("reload_weights") == 1
    # The prefix cache held KV of the old weights: reset with every load.
    assert FakeLLM.instances[0].log.count("reset_prefix_cache") == 1


def test_a_prefix_cache_that_could_not_be_reset_stops_the_weight_load(fake_vllm: Any) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    FakeLLM.instances[0].prefix_cache_resets = False
    with pytest.raises(RuntimeError, match="prefix cache"):
        rollout.sync_weights([("w", torch.zeros(1))], version=1)
    assert rollout.synced_version is None


def test_the_engine_process_settings_are_forced(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")   # recorded, so the test leaves it as found
    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")
    module = vllm_rollout.import_vllm()
    monkeypatch.setattr(vllm_rollout, "import_vllm", REAL_IMPORT_VLLM)
    monkeypatch.setitem(__import__("sys").modules, "vllm", module)
    vllm_rollout.import_vllm()
    # In-process engine (weights reloaded in place).
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    assert "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION" not in os.environ      # TP=1: vLLM's own ids are fine
    # A tensor-parallel engine: request ids as we gave them (equal on the ranks).
    monkeypatch.setattr(vllm_rollout, "remove_stale_cpu_shm", lambda rank, tp: [])
    vLLMRollout(None, _rollout_config(**{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}), _Tok(), "/m")
    assert os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"


def test_the_engine_starts_on_the_device_the_actor_sees(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ray actor on GPU 3 of its node sees one GPU, cuda:0; vLLM reads LOCAL_RANK for its device.
    monkeypatch.setenv("LOCAL_RANK", "3")
    vLLMRollout(None, _rollout_config(), _Tok(), "/m", device="cuda", device_index=0)
    assert FakeLLM.instances[0].local_rank_at_start == "0"
    assert os.environ["LOCAL_RANK"] == "3"     # put back for the rest of the worker


def test_engine_defaults_cost_no_gpu_time() -> None:
    args = engine_args_from(_rollout_config(), "/m", seed=5, device="cuda")
    assert args["load_format"] == "dummy" and args["enable_prefix_caching"] is True
    assert args["enforce_eager"] is False and "distributed_executor_backend" not in args
    assert engine_args_from(_rollout_config(**{"actor_rollout_ref.rollout.load_format": "dummy_dtensor"}),
                            "/m", 5, "cuda")["load_format"] == "dummy"
    tp2 = engine_args_from(_rollout_config(**{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}),
                           "/m", 5, "cpu")
    assert tp2["distributed_executor_backend"] == "external_launcher" and tp2["tensor_parallel_size"] == 2
    # The vLLM 0.6 workaround is gone from the launchers (it breaks current vLLM).
    for script in ("train_grpo.sh", "train_ppo.sh"):
        assert "XFORMERS" not in open(script).read()


def test_one_eos_set_reaches_the_engine_and_ignore_eos_drops_it(fake_vllm: Any) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    rollout.generate_sequences(_prompts())
    params = FakeLLM.instances[0].llm_engine.last_params
    assert params.stop_token_ids == [1, 7] and params.ignore_eos is False
    ignoring = vLLMRollout(None, _rollout_config(**{"actor_rollout_ref.rollout.ignore_eos": True}), _Tok(), "/m")
    ignoring.generate_sequences(_prompts())
    params = FakeLLM.instances[1].llm_engine.last_params
    assert params.stop_token_ids is None and params.ignore_eos is True


def test_a_failed_call_aborts_its_requests_and_the_next_call_uses_new_ids(fake_vllm: Any) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    engine = FakeLLM.instances[0].llm_engine
    engine.fail_next_step = True
    with pytest.raises(RuntimeError, match="engine step failed"):
        rollout.generate_sequences(_prompts())
    assert FakeLLM.instances[0].log == ["abort:1-0,1-1"] and not engine.requests
    out = rollout.generate_sequences(_prompts())     # ids 2-0, 2-1: no clash even without the abort
    assert out.batch[K.RESPONSES][:, 0].tolist() == [5, 5]
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is True


def test_step_engine_seeds_only_sampled_requests_and_aborts_with_its_prefix(fake_vllm: Any) -> None:
    log: list[str] = []
    engine = FakeEngine(log)
    sampled = VLLMStepEngine(engine, FakeParams(temperature=1.0), "7-", seeded=True)
    sampled.add("0", [3, 4], seed=11)
    greedy = VLLMStepEngine(engine, FakeParams(temperature=0.0), "8-", seeded=False)
    greedy.add("0", [3, 4], seed=11)
    assert engine.requests["7-0"].seed == 11 and engine.requests["8-0"].seed is None
    greedy.abort(["0"])
    assert log == ["abort:8-0"]
    assert [rid for rid, _ in sampled.step()] == ["0"]   # the prefix is the engine's business only


def test_log_probs_are_compared_with_the_actors_only_when_they_are_the_same_quantity() -> None:
    def mode(**kw: Any) -> tuple[str, bool]:
        return log_probs_mode(_rollout_config(**{f"actor_rollout_ref.rollout.{k}": v for k, v in kw.items()}))

    assert mode() == ("processed_logprobs", True)                       # full softmax at T
    assert mode(temperature=0.7) == ("processed_logprobs", True)
    assert mode(top_p=0.9) == ("raw_logprobs", True)                    # T = 1: raw is the actor's
    assert mode(top_k=20, temperature=0.7) == ("processed_logprobs", False)


def test_an_output_without_a_log_prob_per_sampled_id_is_an_error_not_zeros() -> None:
    # they are the rollout correction's ratio and bypass mode's PPO anchor: zeros would train silently
    def output(logprobs: Any) -> Any:
        return SimpleNamespace(request_id="r7", outputs=[SimpleNamespace(token_ids=[5, 6], logprobs=logprobs)])

    step = [{5: SimpleNamespace(logprob=-0.5)}, {6: SimpleNamespace(logprob=-1.5)}]
    assert vllm_rollout.sampled_ids_and_log_probs(output(step)) == ([5, 6], [-0.5, -1.5])
    with pytest.raises(RuntimeError, match="2 sampled ids but none log-probs for request r7"):
        vllm_rollout.sampled_ids_and_log_probs(output(None))
    with pytest.raises(RuntimeError, match="2 sampled ids but 1 log-probs"):
        vllm_rollout.sampled_ids_and_log_probs(output(step[:1]))
    empty = SimpleNamespace(request_id="r8", outputs=[SimpleNamespace(token_ids=[], logprobs=None)])
    assert vllm_rollout.sampled_ids_and_log_probs(empty) == ([], [])


def test_gap_metric_skips_log_probs_that_are_not_the_actors() -> None:
    from verl.trainer.ppo.metric_utils import compute_rollout_log_prob_gap

    tensors = {K.ROLLOUT_LOG_PROBS: torch.full((2, 3), -1.0), K.OLD_LOG_PROBS: torch.full((2, 3), -2.0),
               K.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.long)}
    batch = DataProto.from_dict(tensors=tensors)
    assert compute_rollout_log_prob_gap(batch)["rollout/log_prob_gap_mean"] == pytest.approx(1.0)
    batch.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = False
    assert compute_rollout_log_prob_gap(batch) == {"rollout/log_prob_gap_comparable": 0.0}


# --- the worker: one wake per rollout, tensor-parallel ranks agree ------------------------------


class RecordingRollout:
    """Stands in for vLLMRollout inside the worker: counts wakes, sleeps and generate calls."""

    log_probs_match_actor = True

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.synced_version = 0

    def wake_up(self, load_weights: Any) -> None:
        self.calls.append("wake_up")
        load_weights()

    def sleep(self) -> None:
        self.calls.append("sleep")

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.calls.append("generate")
        return prompts


def _worker(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, tp: int) -> Any:
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_trainer_config("/nonexistent/model", **{
        "actor_rollout_ref.rollout.tensor_model_parallel_size": tp,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4, "actor_rollout_ref.rollout.seed": 3})
    OmegaConf.resolve(cfg)
    return ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout")


def test_a_multi_turn_rollout_wakes_the_engine_once(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _worker(monkeypatch, 0, 1, 1)
    worker.device, worker.tokenizer, worker.eos_token_ids = "cpu", _Tok(), (1,)
    worker._weights_version = 0
    worker.rollout = RecordingRollout()
    worker.rollout_wake_up()
    worker.rollout_wake_up()                    # the manager nests inside the trainer's phase
    for _ in range(3):                          # max_turns + 1 engine calls
        worker.generate_sequences(_prompts())
    assert worker.rollout_sleep() is None       # inner: still awake
    assert worker.rollout_sleep() == {"engine_wake_ups": 1}
    assert worker.rollout.calls == ["wake_up", "generate", "generate", "generate", "sleep"]
    # Outside a rollout each call wakes and sleeps on its own (one-off generation).
    worker.rollout.calls.clear()
    worker.generate_sequences(_prompts())
    assert worker.rollout.calls == ["wake_up", "generate", "sleep"]
    with pytest.raises(RuntimeError, match="without a rollout_wake_up"):
        worker.rollout_sleep()


def test_tensor_parallel_ranks_share_rows_and_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = [_worker(monkeypatch, rank, 4, 2) for rank in range(4)]
    assert [w.get_mesh_rank("rollout") for w in workers] == [
        MeshRank(0, 2, True), MeshRank(0, 2, False), MeshRank(1, 2, True), MeshRank(1, 2, False)]
    seeds = [w._sampling_seed() for w in workers]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3]
    # Without TP every rank is its own engine with its own seed.
    assert len({_worker(monkeypatch, rank, 4, 1)._sampling_seed() for rank in range(4)}) == 4
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 must be >= 1 and divide the 4 workers"):
        _worker(monkeypatch, 0, 4, 3)


def test_async_rollout_refuses_tensor_parallel_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _worker(monkeypatch, 0, 2, 2)
    with pytest.raises(NotImplementedError, match="mode=async with tensor_model_parallel_size>1"):
        worker.generate_trajectories(_prompts())


def test_tensor_parallel_ranks_reseed_from_the_drivers_seed_and_check_they_agree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers import rollout_role

    ranks = [_worker(monkeypatch, rank, 4, 2) for rank in range(4)]
    draws = []
    for worker in ranks:
        worker.device, worker.tokenizer, worker.eos_token_ids = "cpu", _Tok(), (1,)
        worker._weights_version = 0
        worker.rollout = RecordingRollout()
        torch.manual_seed(100 + worker.rank)        # each rank restored its own RNG state
        worker.rollout_wake_up(seed=42)
        draws.append(torch.rand(1).item())
        worker.rollout_sleep()
    assert draws[0] == draws[1] != draws[2] == draws[3]

    # A rank of the engine compares its sampled ids with its peers'; a mismatch stops the call.
    peer_ids = torch.tensor([[5, 6, 7]])
    worker = ranks[1]
    worker._rollout_tp_group = object()

    def all_gather(out, mine, group):
        out[0].copy_(mine)
        weights = torch.arange(1, peer_ids.numel() + 1).reshape(peer_ids.shape)
        out[1].copy_(torch.tensor([int((peer_ids * weights).sum()), peer_ids.numel()]))

    monkeypatch.setattr(rollout_role.dist, "all_gather", all_gather)
    agreeing = DataProto.from_dict(tensors={K.RESPONSES: peer_ids.clone()})
    worker._check_tensor_parallel_agreement(agreeing)
    with pytest.raises(RuntimeError, match="sampled different ids"):
        worker._check_tensor_parallel_agreement(DataProto.from_dict(tensors={K.RESPONSES: torch.tensor([[5, 6, 8]])}))


def test_only_the_collecting_rank_of_an_engine_returns_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers import rollout_role

    monkeypatch.setattr(rollout_role.dist, "all_gather", lambda out, mine, group: [o.copy_(mine) for o in out])
    outs = []
    for rank in (0, 1):
        worker = _worker(monkeypatch, rank, 2, 2)
        worker.device, worker.tokenizer, worker.eos_token_ids = "cpu", _Tok(), (1,)
        worker._weights_version, worker._rollout_tp_group = 0, object()

        class Echo(RecordingRollout):
            def generate_sequences(self, prompts: DataProto) -> DataProto:
                out = DataProto.from_dict(tensors={K.RESPONSES: prompts.batch[K.INPUT_IDS]})
                out.meta_info["x"] = 1
                return out

        worker.rollout = Echo()
        outs.append(worker.generate_sequences(_prompts()))
    assert len(outs[0]) == 2 and K.RESPONSES in outs[0].batch.keys()
    assert outs[1].batch is None and outs[1].meta_info == {"x": 1}


def test_the_colocated_sync_is_the_pipelined_push_cast_per_shard_with_a_tied_weight_gathered_once(
        fake_vllm: Any, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: str) -> None:
    """The actor's weights reach its own vLLM engine as a pipeline's push reaches a rollout pool's
    (weight_sync.local_push): each tensor cast to the engine's dtype before its gather, the tied
    lm_head gathered once and handed to the engine under both names, the same tensor."""
    from transformers import AutoModelForCausalLM

    from verl.workers import weight_sync

    worker = _worker(monkeypatch, 0, 1, 1)
    worker.device, worker._weights_version = "cpu", 4
    actor = worker.actor_module = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert actor.lm_head.weight is actor.model.embed_tokens.weight   # fp32 masters, tied head
    worker.rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")
    llm = FakeLLM.instances[0]
    llm.llm_engine.model_config = SimpleNamespace(dtype=torch.bfloat16)   # a GPU engine's weights
    gathers: list[torch.dtype] = []
    gather = weight_sync.full_tensor
    monkeypatch.setattr(weight_sync, "full_tensor", lambda t: gathers.append(t.dtype) or gather(t))

    worker._load_rollout_weights()
    manifest = weight_sync.push_manifest(actor, torch.bfloat16)
    assert [name for name, _ in llm.loaded] == manifest.load_names
    loaded = dict(llm.loaded)
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
    assert {tensor.dtype for _, tensor in llm.loaded} == {torch.bfloat16}
    assert gathers == [torch.bfloat16] * len(manifest.tensors)        # cast first; one gather per distinct tensor
    n_params = sum(p.numel() for p in actor.parameters())             # the tied tensor once
    assert worker.rollout.last_sync_bytes == manifest.nbytes == 2 * n_params
    assert worker.rollout.synced_version == 4
    for name, tensor in actor.state_dict().items():
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name
    worker._load_rollout_weights()                                    # same version: nothing moves
    assert llm.log.count("reload_weights") == 1


def test_the_engine_refuses_shards_it_would_gather_itself(fake_vllm: Any) -> None:
    rollout = vLLMRollout(None, _rollout_config(), _Tok(), "/m")

    class Shard(SimpleNamespace):
        def full_tensor(self) -> torch.Tensor:
            raise AssertionError("gathered outside the push")

    with pytest.raises(TypeError, match="model.w is a DTensor shard.*weight_sync.local_push"):
        rollout.sync_weights([("model.w", Shard())], version=1)
