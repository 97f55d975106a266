"""Config rules and settings for agent loops and interactions (veRL's `actor_rollout_ref.rollout.agent.*` and
`multi_turn.interaction_config_path`; docs/agent.md "Your own tools, loops and interactions")."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

AGENT = "actor_rollout_ref.rollout.agent"
PROTOCOL_LOOPS = {"tags": "search_r1_agent", "tool": "tool_agent"}   # as search_r1.llm_agent.agent_loops


def agent_settings(cfg: DictConfig) -> dict[str, Any]:
    """`GenerationConfig`'s agent-loop fields: the default loop, its config file, and the trainer config
    (plain containers: a loop's `self.config`, sent to the rollout workers)."""
    agent = cfg.actor_rollout_ref.rollout.get("agent") or {}
    return {"default_agent_loop": agent.get("default_agent_loop") or None,
            "agent_loop_config_path": agent.get("agent_loop_config_path") or None,
            "interaction_config_path": cfg.actor_rollout_ref.rollout.multi_turn.get("interaction_config_path") or None,
            "trainer_config": OmegaConf.to_container(cfg, resolve=True)}


def uses_own_loops(cfg: DictConfig) -> bool:
    """Whether the config names loops beside the protocol's own (a default or a loop config file), or
    interactions: then rows roll out one loop each and need their chat messages (raw_prompt)."""
    if cfg.actor_rollout_ref.rollout.multi_turn.get("interaction_config_path"):
        return True
    agent = cfg.actor_rollout_ref.rollout.get("agent") or {}
    protocol = "tool" if cfg.actor_rollout_ref.rollout.multi_turn.get("enable", False) else "tags"
    default = agent.get("default_agent_loop")
    return bool(agent.get("agent_loop_config_path")) or (bool(default) and default != PROTOCOL_LOOPS[protocol])


def check_agent_loops(cfg: DictConfig, run: Any, has_gpu: bool | None) -> list[str]:
    """`rollout.agent.*`: the loop config file loads (its classes import, each an AgentLoopBase), the
    default loop is registered and speaks this run's protocol, the loops run in the multi-turn rollout
    (do_search=true) and not in a partial rollout."""
    agent = cfg.actor_rollout_ref.rollout.get("agent") or {}
    errors: list[str] = []
    workers = agent.get("num_workers", 8)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        errors.append(f"{AGENT}.num_workers={workers!r} must be an int >= 1 (accepted for veRL's command lines; "
                      "the loops run in each rollout worker, or the driver in sync mode)")
    errors += _interaction_errors(cfg)
    path, default = agent.get("agent_loop_config_path"), agent.get("default_agent_loop")
    if not path and not default:
        return errors
    from verl.experimental.agent_loop import load_agent_loop_config, registered_agent_loops

    if path:
        try:
            load_agent_loop_config(str(path))
        except (OSError, ValueError) as err:
            errors.append(str(err))
    protocol = "tool" if cfg.actor_rollout_ref.rollout.multi_turn.get("enable", False) else "tags"
    if default and default not in registered_agent_loops():
        errors.append(f"{AGENT}.default_agent_loop={default!r} is not registered; registered: "
                      f"{registered_agent_loops()} (list yours in {AGENT}.agent_loop_config_path)")
    other = {loop: p for p, loop in PROTOCOL_LOOPS.items() if p != protocol}
    if default in other:
        errors.append(f"{AGENT}.default_agent_loop={default} runs the {other[default]} protocol; this run is the "
                      f"{protocol} protocol (actor_rollout_ref.rollout.multi_turn.enable="
                      f"{'true' if protocol == 'tags' else 'false'} runs it)")
    if uses_own_loops(cfg):
        # veRL's own default (single_turn_agent) is what a run without search does anyway
        if not cfg.do_search and not (default == "single_turn_agent" and not path):
            errors.append(f"{AGENT}.* names agent loops, which run in the multi-turn rollout: set do_search=true "
                          "(a tool config without a search tool needs no retrieval server)")
        if cfg.actor_rollout_ref.rollout.get("partial", False):
            errors.append(f"{AGENT}.* with actor_rollout_ref.rollout.partial=true: a partial rollout brings new "
                          "weights between the protocol's turns, which a loop of your own does not expose; "
                          "set rollout.partial=false")
    return errors


def _interaction_errors(cfg: DictConfig) -> list[str]:
    """multi_turn.interaction_config_path: the file loads (each class a BaseInteraction) and the run speaks the
    tool protocol (an interaction's reply is a chat message of the tool protocol's conversation)."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    path = multi_turn.get("interaction_config_path")
    if not path:
        return []
    key = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
    if not multi_turn.get("enable", False):
        return [f"{key} needs the tool protocol (multi_turn.enable=true): an interaction answers with a user "
                "message of the chat conversation, which the tag protocol does not have"]
    if cfg.actor_rollout_ref.rollout.get("partial", False):
        return [f"{key} with actor_rollout_ref.rollout.partial=true: interactions run each row as its own loop, "
                "which a partial rollout does not bring new weights into between turns; set rollout.partial=false"]
    from verl.interactions.utils.interaction_registry import initialize_interactions_from_config

    try:
        initialize_interactions_from_config(str(path))
    except (OSError, ValueError) as err:
        return [str(err)]
    return []


__all__ = ["agent_settings", "check_agent_loops", "uses_own_loops"]
