"""Config rules for the tag protocol's open tag (`open_tag.*`; docs/agent.md "The open tag")."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

# as search_r1.search.documents.MAX_PAGE_SIZE (not imported: the config check stays light)
MAX_PAGE_SIZE = 20000


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def open_tag_settings(cfg: DictConfig) -> dict[str, Any]:
    """`GenerationConfig`'s open-tag fields from `open_tag.*` (defaults when the block is absent)."""
    block = cfg.get("open_tag") or {}
    return {"open_tag": bool(block.get("enable", False)), "max_opens": block.get("max_opens", 2),
            "open_page_size": block.get("page_size", 1000)}


def check_open_tag(cfg: DictConfig, run: Any, has_gpu: bool | None) -> list[str]:
    """`open_tag.enable` needs the tag protocol with searches over an HTTP retrieval server; its bounds are positive."""
    block = cfg.get("open_tag") or {}
    enable = block.get("enable", False)
    if not isinstance(enable, bool):
        return [f"open_tag.enable={enable!r} must be true or false"]
    if not enable:
        return []
    errors: list[str] = []
    if not cfg.do_search:
        errors.append("open_tag.enable=true needs do_search=true (the policy opens documents its searches found)")
    if cfg.actor_rollout_ref.rollout.multi_turn.get("enable", False):
        errors.append("open_tag.enable=true is the tag protocol's; with actor_rollout_ref.rollout.multi_turn.enable=true "
                      "declare an open tool in multi_turn.tool_config_path instead "
                      "(example/tool_recipe/config/tool_config/search_open_tool_config.yaml)")
    if cfg.retriever.get("serve") == "ray":
        errors.append("open_tag.enable=true reads documents through retriever.url's POST /open; "
                      "retriever.serve=ray is not supported with it")
    if not _positive_int(block.get("max_opens", 2)):
        errors.append(f"open_tag.max_opens={block.get('max_opens')!r} must be an integer >= 1 (opens one row may run)")
    size = block.get("page_size", 1000)
    if not _positive_int(size) or size > MAX_PAGE_SIZE:
        errors.append(f"open_tag.page_size={size!r} must be an integer in [1, {MAX_PAGE_SIZE}] (characters of a page)")
    return errors
