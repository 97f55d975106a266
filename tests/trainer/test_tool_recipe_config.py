"""veRL upstream's Search-R1 recipe (example/tool_recipe/) composes here and means what it means in veRL.

The shipped launcher runs with a stand-in `python3` that records its arguments; the exact list it
would hand to `verl.trainer.main_ppo` (`--config-path` / `--config-name` + veRL's overrides) is
composed through `compose_config`, the path main_ppo's command line takes, checked for the world it
states (8 GPUs) and followed to the GenerationConfig the trainer builds and the per-worker batch
sizes the workers compute. Each new key's errors, both `val_before_train` forms, and the tool
protocol's start-up probe are checked here too.
"""

from __future__ import annotations

import copy
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from tests.multinode._launch_record import run_recorded
from verl.trainer.config_check import (
    ConfigError,
    config_errors,
    validate_config,
)
from verl.trainer.config_schema import normalize_overrides, trainer_flag
from verl.trainer.main_ppo import compose_config
from verl.trainer.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "example/tool_recipe/run_qwen2.5-3b_instruct_search_multiturn.sh"
RECIPE_DIR = REPO / "example" / "tool_recipe" / "config"
TOOL_CONFIG = RECIPE_DIR / "tool_config" / "search_tool_config.yaml"


def _recorded(tmp_path: Path, engine: str | None) -> tuple[str, str, list[str]]:
    """(config dir, config name, overrides) the shipped script passes to main_ppo."""
    env = {"TRAIN_DATA": str(tmp_path / "train.parquet"), "VAL_DATA": str(tmp_path / "test.parquet")}
    if engine is not None:
        env["ROLLOUT_NAME"] = engine
    run = run_recorded(SCRIPT, tmp_path, env)
    assert run.returncode == 0, run.output
    args = list(run.overrides)
    options = {}
    for flag in ("--config-path", "--config-name"):
        (arg,) = [a for a in args if a.startswith(flag + "=")]
        options[flag] = arg.split("=", 1)[1]
        args.remove(arg)
    return options["--config-path"], options["--config-name"], args


def _recipe(tmp_path: Path, engine: str | None = "vllm", extra: tuple[str, ...] = ()):
    config_dir, name, overrides = _recorded(tmp_path, engine)
    cfg = compose_config(overrides + list(extra), config_name=name, config_dir=config_dir)
    OmegaConf.resolve(cfg)
    return cfg


def test_the_script_passes_verls_override_list_with_our_engine(tmp_path: Path) -> None:
    config_dir, name, overrides = _recorded(tmp_path, None)
    assert (Path(config_dir), name) == (RECIPE_DIR, "search_multiturn_grpo")
    keys = [o.split("=", 1)[0] for o in overrides]
    assert len(keys) == len(set(keys)) == 44       # veRL's list: 44 overrides, each key once
    assert "actor_rollout_ref.rollout.name=vllm" in overrides          # veRL: sglang
    for item in ("data.truncation=error", "trainer.val_before_train=False", "actor_rollout_ref.rollout.n=5",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.max_model_len=15000",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}", "trainer.total_epochs=1"):
        assert item in overrides, item
    assert not any(o.startswith("+") for o in overrides)   # veRL's form: nothing appended


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_the_recipe_composes_validates_on_8_gpus_and_keeps_verls_meanings(tmp_path: Path, engine: str) -> None:
    cfg = _recipe(tmp_path, engine)
    validate_config(cfg)
    assert config_errors(copy.deepcopy(cfg), has_gpu=None) == []
    rollout, data = cfg.actor_rollout_ref.rollout, cfg.data
    assert RunConfig.from_config(cfg).pools.world_size == 8 and rollout.name == engine
    assert RunConfig.from_config(cfg).protocol.tool
    assert (rollout.multi_turn.max_assistant_turns, rollout.multi_turn.format) == (2, "qwen")   # the recipe YAML
    assert (data.max_prompt_length, data.max_response_length) == (4096, 3000)   # the command line wins over the YAML
    assert data.return_raw_chat is True and data.truncation == "error" and data.filter_overlong_prompts is True
    assert RunConfig.from_config(cfg).protocol.shuffle_train is False                                          # data.shuffle: False (veRL's name)
    assert trainer_flag(cfg, "val_before_train") is False                      # without `+`
    assert cfg.algorithm.use_kl_in_reward is False and cfg.actor_rollout_ref.actor.use_kl_loss is True
    # veRL's mini-batch semantics: 256 prompts x rollout.n=5 = 1280 rollouts; 512 x 5 = 2560 a step -> 2 steps.
    assert RunConfig.from_config(cfg).batches.optimizer_steps["actor"] == 2


def test_the_recipe_reaches_the_workers_as_per_gpu_micro_batches(tmp_path: Path) -> None:
    from verl.workers.fsdp_workers import normalize_actor_batch_sizes

    cfg = _recipe(tmp_path)
    actor = copy.deepcopy(cfg.actor_rollout_ref)
    normalize_actor_batch_sizes(actor, "actor_rollout_ref", RunConfig.from_config(cfg).pools.world_size)
    assert actor.actor.ppo_mini_batch_size == 160                         # 256 x 5 / 8 rows per worker
    # veRL's _per_gpu values are rows per worker: not divided again.
    assert actor.actor.ppo_micro_batch_size == actor.actor.ppo_micro_batch_size_per_gpu == 8
    assert actor.rollout.log_prob_micro_batch_size == actor.ref.log_prob_micro_batch_size == 8


def test_the_trainer_builds_a_tool_protocol_generation_config_from_the_recipe(tmp_path: Path) -> None:
    from verl.trainer.ppo.rollout_setup import generation_config

    cfg = _recipe(tmp_path)
    gen = generation_config(cfg, RunConfig.from_config(cfg).pools.world_size)
    assert gen.protocol == "tool"
    assert [s["function"]["name"] for s in gen.tool_config["schemas"]] == ["search"]
    assert gen.search_url == "http://127.0.0.1:8000/retrieve"            # the tool config's, not retriever.url
    # veRL's num_workers / rate_limit (120) cap the whole job: 15 in flight per rollout worker of 8.
    assert (gen.topk, gen.retrieval_timeout, gen.retrieval_concurrency) == (3, 30.0, 15)
    # veRL's budgets: the prompt bound, then all turns together; the rolling context is never cut.
    assert (gen.max_start_length, gen.max_total_response_length, gen.max_response_length) == (4096, 3000, 3000)
    assert gen.max_prompt_length == 4096 + 3000
    assert (gen.max_assistant_turns, gen.max_user_turns, gen.max_parallel_calls) == (2, None, 1)
    assert (gen.max_tool_response_length, gen.tool_response_truncate_side) == (256, "middle")
    assert gen.stop == ("</tool_call>",)
    tags = generation_config(compose_config([]), 8)
    assert tags.protocol == "tags" and tags.stop == ("</search>", "</answer>")


def test_max_model_len_goes_to_the_vllm_engine_args(tmp_path: Path) -> None:
    from verl.workers.rollout.vllm_rollout import engine_args_from

    cfg = _recipe(tmp_path)
    assert engine_args_from(cfg.actor_rollout_ref.rollout, "m", seed=0, device="cpu")["max_model_len"] == 15000
    default = compose_config([])
    OmegaConf.resolve(default)
    assert engine_args_from(default.actor_rollout_ref.rollout, "m", seed=0, device="cpu")["max_model_len"] == 4096 + 500


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_the_recipe_passes_preflight_through_main_ppos_command_line(tmp_path: Path) -> None:
    # Preflight reads the data files and asks the tool config's retrieval server: give it both
    # (tool-format rows, a real BM25 server behind a copy of the shipped tool config).
    import yaml

    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from tests.trainer._preflight_data import write_data
    from tests.trainer._search_model import build_bm25_retriever, write_corpus

    config_dir, name, overrides = _recorded(tmp_path, "vllm")
    write_data(tmp_path, source="searchR1_nq")
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    tool_config = yaml.safe_load((RECIPE_DIR / "tool_config" / "search_tool_config.yaml").read_text())
    with serve_in_background(create_app(build_bm25_retriever(corpus, tmp_path / "index"))) as url:
        tool_config["tools"][0]["config"]["retrieval_service_url"] = f"{url}/retrieve"
        (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tool_config))
        run = _cli(f"--config-path={config_dir}", f"--config-name={name}", *overrides, "+trainer.preflight=true",
                   f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
                   f"trainer.default_local_dir={tmp_path / 'ckpt'}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "preflight OK" in run.stdout
    assert "actor per worker: mini-batch 160 rows, micro-batch 8, log-prob micro-batch 8" in run.stdout
    assert f"retrieval_service_url={url}/retrieve answers: retriever=bm25" in run.stdout


def test_val_before_train_composes_in_both_forms_on_the_command_line() -> None:
    # `--cfg job` prints the composed config and stops: the real CLI, Hydra included.
    verl_form = _cli("--cfg", "job", "trainer.val_before_train=false", "trainer.val_only=true")
    assert verl_form.returncode == 0, verl_form.stderr
    assert "val_before_train: false" in verl_form.stdout and "val_only: true" in verl_form.stdout
    both = _cli("--cfg", "job", "+trainer.val_before_train=false", "trainer.val_before_train=true")
    assert both.returncode == 0, both.stderr
    assert "val_before_train: true" in both.stdout     # the last value wins, as for any key


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], True),
    (["+trainer.val_before_train=false"], False),            # the original's form
    (["trainer.val_before_train=false"], False),             # veRL's form
    (["++trainer.val_before_train=false"], False),
    (["+trainer.val_before_train=false", "trainer.val_before_train=true"], True),
])
def test_val_before_train_composes_in_both_forms(overrides: list[str], expected: bool) -> None:
    cfg = compose_config(overrides)
    validate_config(cfg)
    assert trainer_flag(cfg, "val_before_train") is expected


def test_normalize_overrides_leaves_other_arguments_alone() -> None:
    args = ["--config-path=/x", "data.train_batch_size=8", "+trainer.val_only=true", "trainer.preflight=true",
            "trainer.val_only=false", "~critic.model.path"]
    assert normalize_overrides(args) == ["--config-path=/x", "data.train_batch_size=8", "++trainer.preflight=true",
                                         "++trainer.val_only=false", "~critic.model.path"]


SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo"]
TOOL = ["actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor_rollout_ref.actor.ppo_micro_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
     "actor_rollout_ref.actor.ppo_micro_batch_size=2 and actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 are both set"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"],
     "actor_rollout_ref.rollout.log_prob_micro_batch_size=2 and actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size=2", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"],
     "actor_rollout_ref.ref.log_prob_micro_batch_size=2 and actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"),
    (["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1"],
     "critic.ppo_micro_batch_size=2 and critic.ppo_micro_batch_size_per_gpu=1 are both set"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0 must be an int >= 1"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu*world_size=6 is larger than the mini-batch of 4 rollouts"),
    (["actor_rollout_ref.rollout.name=sglang"],
     "rollout.name=sglang is not available in this project (see docs/rollout.md, 'SGLang'): use rollout.name=vllm "
     "(or hf); veRL's async agent loop corresponds to rollout.mode=async"),
    (["actor_rollout_ref.rollout.name=sglang_async"], "rollout.name=sglang_async is not available in this project"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true"],
     "actor_rollout_ref.rollout.multi_turn.enable=true needs actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.tool_config_path=/no/such.yaml"],
     "actor_rollout_ref.rollout.multi_turn.tool_config_path: no file /no/such.yaml"),
    ([*TOOL, "do_search=false"], "do_search=false turns the search loop off"),
    (["actor_rollout_ref.rollout.multi_turn.format=llama3_json"],
     "actor_rollout_ref.rollout.multi_turn.format='llama3_json' is not supported; supported: ['hermes', 'qwen']"),
    (["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"],
     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0 must be an int >= 1 or null"),
    (["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"],
     "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side='top' is unknown"),
    (["data.truncation=cut"], "data.truncation='cut' is unknown; choose one of ['error', 'left', 'right', 'middle']"),
    (["data.shuffle=false", "data.shuffle_train_dataloader=true"],
     "data.shuffle=False and data.shuffle_train_dataloader=True are one setting"),
    (["actor_rollout_ref.rollout.max_model_len=4000"],
     "actor_rollout_ref.rollout.max_model_len=4000 is shorter than a rollout's context: "
     "actor_rollout_ref.rollout.prompt_length=4096 + response_length=500 = 4596 tokens"),
    (["+data.dataloader_num_workers=4"],
     "data.dataloader_num_workers is not a setting of this project (verl/trainer/config/ppo_trainer.yaml declares "
     "no such key), so it would have no meaning here: remove it"),
    (["+actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=strict"],
     "tokenization_sanity_check_mode is not a setting of this project"),
])
def test_each_new_key_fails_with_a_message_naming_it(overrides: list[str], message: str) -> None:
    cfg = compose_config(SMALL + overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)


def test_settings_that_agree_pass() -> None:
    for overrides in (["data.shuffle=false", "data.shuffle_train_dataloader=false"],
                      ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"],
                      ["actor_rollout_ref.rollout.max_model_len=4596"], ["data.truncation=middle"],
                      [*TOOL, "actor_rollout_ref.rollout.multi_turn.format=hermes"],
                      ["+actor_rollout_ref.model.override_config.attention_dropout=0.0"]):
        validate_config(compose_config(SMALL + overrides))


def test_an_undeclared_key_on_the_command_line_says_it_has_no_meaning_here() -> None:
    with pytest.raises(ConfigError, match=r"use_inference_chat_template is not a setting of this project .* "
                                          r"no meaning here: remove it \(the rollout is the model's own ids"):
        compose_config(["actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true"])
    run = _cli("data.dataloader_num_workers=2", "+trainer.preflight=true")
    assert run.returncode == 1
    assert "data.dataloader_num_workers is not a setting of this project" in run.stderr
    assert "To append to your config use +" not in run.stderr       # Hydra's advice would only defer the error


def test_a_recipe_yaml_cannot_add_keys_silently(tmp_path: Path) -> None:
    (tmp_path / "my_recipe.yaml").write_text(
        f"hydra:\n  searchpath:\n    - file://{REPO / 'verl/trainer/config'}\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  custom_cls: my.Dataset\n")
    cfg = compose_config(SMALL, config_name="my_recipe", config_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"data.custom_cls is not a setting of this project .*RLHFDataset"):
        validate_config(cfg)


def test_workers_divide_a_global_micro_batch_and_keep_a_per_gpu_one() -> None:
    from verl.workers.fsdp_workers import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    cfg = compose_config(SMALL + ["trainer.n_gpus_per_node=4", "data.train_batch_size=16",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=gae",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                                  "critic.ppo_micro_batch_size_per_gpu=2"])
    OmegaConf.resolve(cfg)
    actor, critic = copy.deepcopy(cfg.actor_rollout_ref), copy.deepcopy(cfg.critic)
    normalize_actor_batch_sizes(actor, "actor_rollout_ref", 4)
    normalize_critic_batch_sizes(critic, 4)
    assert (actor.actor.ppo_micro_batch_size, actor.actor.ppo_micro_batch_size_per_gpu) == (2, 2)   # 8 / 4
    assert (actor.rollout.log_prob_micro_batch_size, actor.rollout.log_prob_micro_batch_size_per_gpu) == (3, 3)
    assert actor.ref.log_prob_micro_batch_size == 128 // 4                                          # both null
    assert (critic.ppo_micro_batch_size, critic.forward_micro_batch_size) == (2, 2)   # forward follows per_gpu
    both = copy.deepcopy(cfg.actor_rollout_ref)
    both.actor.ppo_micro_batch_size_per_gpu = 1
    with pytest.raises(ValueError, match="ppo_micro_batch_size=8 and actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"):
        normalize_actor_batch_sizes(both, "actor_rollout_ref", 4)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


def test_the_start_up_probe_asks_the_tool_configs_retrieval_server(tmp_path: Path) -> None:
    import yaml

    from verl.trainer.main_ppo import wait_for_retriever

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        tool_config = yaml.safe_load(TOOL_CONFIG.read_text())
        tool_config["tools"][0]["config"]["retrieval_service_url"] = f"{url}/retrieve"
        path = tmp_path / "tools.yaml"
        path.write_text(yaml.safe_dump(tool_config))
        # retriever.url points nowhere: in the tool protocol it is not the server the rollouts query.
        dead = ["retriever.url=http://127.0.0.1:9/retrieve", "retriever.health_wait_s=2"]
        cfg = compose_config(dead + ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                     f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"])
        assert wait_for_retriever(cfg) == f"{url}/health"
        with pytest.raises(RuntimeError, match=r"retriever.url=http://127.0.0.1:9/retrieve did not answer"):
            wait_for_retriever(compose_config(dead))
    finally:
        server.shutdown()


def test_verls_preprocessed_rows_feed_the_trainer_in_the_tool_protocol(tmp_path: Path, tiny_model_dir: str) -> None:
    """The trainer's datasets and generation manager from veRL-layout rows and the recipe's tool config."""
    from transformers import AutoTokenizer

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager
    from verl.utils.tiny_model import TOOL_CHAT_TEMPLATE

    rows = [{"data_source": "searchR1_nq", "ability": "fact-reasoning", "metadata": None,
             "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                        {"role": "user", "content": f"Answer the given question. Question: who{'?' * (i + 1)}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"a{i}"]}},
             "extra_info": {"index": i, "need_tools_kwargs": True, "question": "who", "split": "train",
                            "tools_kwargs": {"search": {"create_kwargs": {"ground_truth": {"target": [f"a{i}"]},
                                                                          "question": "who", "data_source": "searchR1_nq"}}}}}
            for i in range(4)]
    for split in ("train", "test"):
        pd.DataFrame(rows).to_parquet(tmp_path / f"{split}.parquet")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    cfg = compose_config(SMALL + TOOL + [
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.return_raw_chat=true",
        f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_prompt_length=2048", "data.max_response_length=256",
        "data.max_obs_length=128"])
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    trainer = RayPPOTrainer(cfg, tok, {}, ResourcePoolManager({}, {}), reward_fn=lambda batch: None)
    assert len(trainer.train_dataset) == 4 and trainer.train_dataset.input_ids.shape[1] == 2048
    item = trainer.train_dataset[0]
    text = tok.decode(item["input_ids"][item["attention_mask"].bool()])
    assert '"name": "search"' in text and "# Tools" in text and text.endswith("<|im_start|>assistant\n")
    assert item["raw_prompt"][0]["role"] == "system"
    assert item["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]["ground_truth"] == {"target": ["a0"]}
    manager = trainer._generation_manager(validation=False)
    assert manager.config.protocol == "tool" and manager.config.max_start_length == 2048
    batch = next(iter(trainer.train_dataloader))
    assert list(batch.non_tensor_batch["raw_prompt"][0][1]) == ["role", "content"]


@pytest.mark.slow
def test_a_step_runs_with_raw_chat_in_the_batch_and_verls_val_before_train(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    """data.return_raw_chat=true: the messages ride through repeat, dispatch, balance and reward."""
    from transformers import AutoTokenizer

    from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
    from verl.trainer.main_ppo import run_ppo

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="grpo", n_agent=2)
                         + ["data.return_raw_chat=true", "trainer.val_before_train=true"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    assert "val/test_score/toy_contains" in history[0]          # validated before training (veRL's form)
    assert any("actor/pg_loss" in step for step in history)


def test_too_many_failed_searches_name_the_tool_configs_server(tmp_path: Path) -> None:
    from verl.trainer.ppo.rollout_setup import SearchFailureError, check_search_failures

    cfg = _recipe(tmp_path, extra=("retriever.url=http://10.0.0.9:8000/retrieve",))
    with pytest.raises(SearchFailureError) as info:
        check_search_failures({"env/search_failure_fraction": 0.9}, cfg, "rollout of training step 3")
    # The tool protocol searches the tool config's server, not retriever.url: the message says which.
    assert "retrieval_service_url" in str(info.value) and str(TOOL_CONFIG) in str(info.value)
    assert "GET http://127.0.0.1:8000/health" in str(info.value) and "10.0.0.9" not in str(info.value)
