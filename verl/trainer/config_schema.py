"""What keys the trainer config may hold: the schema (ppo_trainer.yaml), the optional trainer keys,
the overrides as Hydra composes them, and the one error type every config check raises.

    check_override_keys(argv)               # a plain `key=value` of an undeclared key: ConfigError
    undeclared_keys(cfg)                    # keys a `+key=` or a recipe YAML added
    normalize_overrides(argv)               # `+trainer.val_only=...` and `trainer.val_only=...` alike
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

SCHEMA_PATH = Path(__file__).parent / "config" / "ppo_trainer.yaml"


class ConfigError(ValueError):
    """A contradiction or an unsupported value in the trainer config; `messages` holds each problem."""

    def __init__(self, message: str, messages: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.messages = list(messages) if messages is not None else [message]


def raise_if(errors: Sequence[str]) -> None:
    """ConfigError("invalid trainer config: - ...") listing `errors`, when there are any."""
    if errors:
        raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors), errors)


# veRL keys a user of its recipes may pass that have no meaning in this project; the reason is
# added to the "not a setting of this project" message (a prefix matches its sub-keys).
VERL_KEYS_WITHOUT_MEANING: dict[str, str] = {
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template":
        "the rollout is the model's own ids plus the chat template's tool messages (token-exact), as veRL's False",
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode":
        "rollouts are token-exact by construction: the model's ids are kept, only tool messages are tokenized",
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts":
        "samples per prompt are actor_rollout_ref.rollout.n (veRL) or rollout.n_agent (Search-R1)",
    "actor_rollout_ref.rollout.calculate_log_probs":
        "the rollout's log-probs are compared with the actor's when the engine returns them (rollout/log_prob_gap)",
    "data.custom_cls": "the dataset is verl/utils/dataset/rl_dataset.py's RLHFDataset",
    "data.image_key": "text-only: no multi-modal inputs",
    "data.video_key": "text-only: no multi-modal inputs",
}
# Keys users append with `+trainer.<key>=...`; not declared in the YAML, read with these defaults.
# `preflight`: check the composed config and exit, without Ray, workers or weights (preflight.py).
OPTIONAL_TRAINER_KEYS: dict[str, Any] = {"val_only": False, "val_before_train": True, "preflight": False,
                                         # a pipelined rollout waits for the weights of the update just
                                         # made (staleness 0: the pipeline's steps equal sync's; tests)
                                         "pipeline_wait_for_sync": False}
def trainer_flag(cfg: DictConfig, key: str) -> Any:
    """Read an optional `trainer.<key>` (see OPTIONAL_TRAINER_KEYS) with its default."""
    if key not in OPTIONAL_TRAINER_KEYS:
        raise KeyError(f"trainer.{key} is not an optional trainer key; known: {sorted(OPTIONAL_TRAINER_KEYS)}")
    return OmegaConf.select(cfg, f"trainer.{key}", default=OPTIONAL_TRAINER_KEYS[key])


def interpolations(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys under `node` whose value is still an `${...}` interpolation (unresolved)."""
    found: list[str] = []
    if isinstance(node, DictConfig):
        items = [(str(k), k) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(str(i), i) for i in range(len(node))]
    else:
        return found
    for name, key in items:
        path = f"{prefix}.{name}" if prefix else name
        if OmegaConf.is_interpolation(node, key):
            found.append(path)
        else:
            found.extend(interpolations(node._get_node(key), path))
    return found


def unknown_key_message(key: str) -> str:
    """Why `key` is refused: not a setting of this project, with the reason for a known veRL key."""
    message = (f"{key} is not a setting of this project (verl/trainer/config/ppo_trainer.yaml declares no such "
               "key), so it would have no meaning here: remove it")
    for known, reason in VERL_KEYS_WITHOUT_MEANING.items():
        if key == known or key.startswith(known + "."):
            return f"{message} ({reason})"
    return message


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.load(SCHEMA_PATH)


def is_declared(key: str) -> bool:
    """Whether the dotted `key` is a setting of ppo_trainer.yaml (inside a free-form mapping such as
    `model.override_config` any key is), or an optional `trainer.<key>` (OPTIONAL_TRAINER_KEYS)."""
    if key.startswith("trainer.") and key.split(".", 1)[1] in OPTIONAL_TRAINER_KEYS:
        return True
    node: Any = _schema()
    for part in key.split("."):
        if isinstance(node, DictConfig) and len(node) == 0:
            return True
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def undeclared_keys(cfg: DictConfig) -> list[str]:
    """Dotted keys of `cfg` that ppo_trainer.yaml does not declare: appended with `+key=...`, or added
    by a recipe YAML (e.g. `--config-name` of a file whose defaults list holds ppo_trainer)."""
    found: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            key = f"{prefix}{name}"
            if not is_declared(key):
                found.append(key)
            elif isinstance(node._get_node(name), DictConfig) and not OmegaConf.is_interpolation(node, name):
                walk(node._get_node(name), key + ".")

    walk(cfg, "")
    return found


_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2})(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)=(?P<value>.*)$", re.DOTALL)


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """Command-line overrides as Hydra composes them here.

    The optional trainer keys (OPTIONAL_TRAINER_KEYS) are not declared in the YAML (DESIGN 3.4),
    so the original's `+trainer.val_before_train=...` appends them; veRL's recipes write
    `trainer.val_before_train=...` without `+`. Both forms (and `++`) become one `++trainer.<key>=`
    (add or override), the last value winning as for any other key. Everything else is unchanged.
    """
    out: list[str] = []
    last: dict[str, int] = {}
    for arg in overrides:
        match = _OVERRIDE.match(arg)
        key = match["key"] if match else ""
        if key.startswith("trainer.") and key.split(".", 1)[1] in OPTIONAL_TRAINER_KEYS:
            if key in last:
                out[last[key]] = ""
            last[key] = len(out)
            out.append(f"++{key}={match['value']}")
        else:
            out.append(arg)
    return [arg for arg in out if arg != ""]


def check_override_keys(overrides: Sequence[str]) -> None:
    """Refuse a plain `key=value` override of a key ppo_trainer.yaml does not declare, with a message
    saying it has no meaning here (Hydra's own would suggest appending it with `+`, which would then be
    refused by `config_errors` anyway). Hydra's own keys (`hydra.*`) pass."""
    errors = []
    for arg in overrides:
        match = _OVERRIDE.match(arg)
        if match and not match["prefix"] and not match["key"].startswith("hydra.") and not is_declared(match["key"]):
            errors.append(unknown_key_message(match["key"]))
    raise_if(errors)
