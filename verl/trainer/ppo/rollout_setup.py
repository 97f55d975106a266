"""What the driver sets up around a rollout: the generation manager's config, the prompt columns a
batch carries, and the stop when too many searches failed.

    gen_config = generation_config(config, world_size)       # GenerationConfig for LLMGenerationManager
    batch = trim_shared_left_padding(batch)                   # prompt columns that are padding everywhere
    check_search_failures(metrics, config, "rollout of step 3")   # SearchFailureError past the bound
    val = ValKwargs.from_config(config.actor_rollout_ref.rollout)  # validation's samples and sampling
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from verl.trainer.run_config import Protocol
from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

GEN_INPUT_KEYS = (K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS)
# Tensors whose first P columns are the (left-padded) prompt.
PROMPT_ALIGNED_KEYS = (K.PROMPTS, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK)


def trim_shared_left_padding(batch: DataProto) -> DataProto:
    """Drop the prompt columns that are padding in every row.

    Prompts arrive left-padded to `data.max_prompt_length`; when the longest prompt of the
    batch is shorter, those columns are pure padding for every later forward pass (old and
    ref log-probs, values, updates). Cutting them changes no logit: positions come from the
    attention mask and padded keys are masked anyway.
    """
    prompt_mask = batch.batch[K.ATTENTION_MASK][:, : batch.batch[K.PROMPTS].shape[-1]]
    shared = int((prompt_mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-pad columns
    if shared == 0:
        return batch
    for key in PROMPT_ALIGNED_KEYS:
        if key in batch.batch.keys():
            batch.batch[key] = batch.batch[key][:, shared:].contiguous()
    return batch


@dataclass(frozen=True)
class ValKwargs:
    """`actor_rollout_ref.rollout.val_kwargs` (veRL's keys and defaults): validation rolls out `n` samples of
    each prompt, sampled when `do_sample` at temperature / top_p / top_k (top_k -1 or 0: off), else greedy.
    The defaults (n=1, greedy) keep validation deterministic (DESIGN §4.4); n > 1 adds veRL's mean@n,
    best@k, worst@k and maj@k (verl/trainer/ppo/validation_metrics.py)."""

    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def from_config(cls, rollout: Any) -> ValKwargs:
        node = rollout.get("val_kwargs") or {}
        return cls(n=int(node.get("n", 1)), do_sample=bool(node.get("do_sample", False)),
                   temperature=float(node.get("temperature", 0.0)), top_p=float(node.get("top_p", 1.0)),
                   top_k=int(node.get("top_k", -1) if node.get("top_k") is not None else -1))

    @staticmethod
    def errors(rollout: Any) -> list[str]:
        """What is wrong with `rollout.val_kwargs`, each naming its key."""
        node, key = rollout.get("val_kwargs") or {}, "actor_rollout_ref.rollout.val_kwargs"
        errors = []
        n = node.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            errors.append(f"{key}.n={n!r} must be an int >= 1 (samples per validation prompt)")
        if not isinstance(node.get("do_sample", False), bool):
            errors.append(f"{key}.do_sample={node.get('do_sample')!r} must be true or false")
        temperature, top_p, top_k = node.get("temperature", 0.0), node.get("top_p", 1.0), node.get("top_k", -1)
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
            errors.append(f"{key}.temperature={temperature!r} must be a number >= 0")
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            errors.append(f"{key}.top_p={top_p!r} must be in (0, 1]")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            errors.append(f"{key}.top_k={top_k!r} must be an int >= -1 (-1 or 0: off)")
        return errors

    def sampling_meta(self) -> dict[str, Any]:
        """The meta_info of a validation generate call: greedy as before unless do_sample."""
        meta: dict[str, Any] = {K.META_VALIDATE: True, K.META_DO_SAMPLE: self.do_sample}
        if self.do_sample:
            meta.update({K.META_TEMPERATURE: self.temperature, K.META_TOP_P: self.top_p, K.META_TOP_K: self.top_k})
        return meta


class SearchFailureError(RuntimeError):
    """Too many of a rollout's searches failed (`retriever.max_failure_fraction`)."""


def check_search_failures(metrics: dict[str, float], config: DictConfig, where: str, prefix: str = "env/") -> None:
    """Stop the run when more than `retriever.max_failure_fraction` of a rollout's searches failed.

    A failed search is an observation the policy would be trained on (a failure notice instead of
    passages); a few are noise, most of a batch means the retrieval server is down or overloaded.
    `metrics` holds `<prefix>search_failure_fraction` (compute_env_metrics; absent without search).
    """
    fraction = metrics.get(f"{prefix}search_failure_fraction")
    limit = float(config.retriever.max_failure_fraction)
    if fraction is None or fraction <= limit:
        return
    from search_r1.search.client import RetrievalClient

    where_key = "retriever.url"
    url = str(config.retriever.url)
    protocol = Protocol.from_config(config)
    if protocol.serve_retriever:
        raise SearchFailureError(
            f"{prefix}search_failure_fraction={fraction:.3f} in the {where} exceeds retriever.max_failure_fraction="
            f"{limit:g}: the run stops instead of training on failed searches. The retrieval application "
            f"{config.retriever.serve_app_name!r} runs on Ray Serve (retriever.serve=ray): see `serve status` and its "
            "replicas' logs under the Ray session's logs/serve/")
    if protocol.tool:
        where_key = f"the search tool's retrieval_service_url ({protocol.tool_config_path})"
        url = str((protocol.tool_config.search or {}).get("retrieval_service_url", url))
    raise SearchFailureError(
        f"{prefix}search_failure_fraction={fraction:.3f} ({prefix}search_failures="
        f"{metrics.get(f'{prefix}search_failures', 0.0):g}) in the {where} exceeds "
        f"retriever.max_failure_fraction={limit:g}: the run stops instead of training on failed searches. "
        f"Check the retrieval server at {where_key}={url}: GET {RetrievalClient(url).health_url} and the "
        "server's log (retriever.max_failure_fraction=1.0 never stops)")


def generation_config(config: DictConfig, world_size: int) -> Any:
    """The generation manager's `GenerationConfig` for the trainer config.

    Tag protocol (the original's `<search>`): the data.* bounds per turn, `retriever.*`, `rollout.stop`.
    Tool protocol (`actor_rollout_ref.rollout.multi_turn.enable`, veRL's recipe): veRL's meanings —
    data.max_prompt_length bounds the prompt, data.max_response_length all turns and tool messages
    of a row together (also the cap of one turn), so the rolling context (prompt + that budget) is
    never cut; the search tool of `multi_turn.tool_config_path` gives the server, topk, timeout and
    concurrency (GenerationConfig splits the job-wide num_workers / rate_limit over the rollout
    workers); multi_turn.* bound the turns and
    tool answers. data.max_obs_length bounds one round of tool messages (tokens); max_turns is the
    tag protocol's and does not bound a tool-protocol row.
    """
    from search_r1.llm_agent.generation import GenerationConfig
    from search_r1.llm_agent.openai_endpoint.rollout import settings_dict
    from verl.trainer.config_agent import agent_settings
    from verl.trainer.config_open_tag import open_tag_settings
    from verl.utils.dataset.rl_dataset import chat_template_kwargs

    data, rollout = config.data, config.actor_rollout_ref.rollout
    protocol = Protocol.from_config(config)
    common = dict(
        max_turns=int(config.max_turns), max_obs_length=int(data.max_obs_length), num_gpus=world_size,
        no_think_rl=bool(config.algorithm.no_think_rl), retrieval_max_retries=int(config.retriever.max_retries),
        topk=int(config.retriever.topk), retrieval_timeout=float(config.retriever.timeout),
        mode=str(rollout.get("mode", "sync")), openai_agent=settings_dict(config),
        serve_app=str(config.retriever.serve_app_name) if protocol.serve_retriever else None,
        chat_template_kwargs=chat_template_kwargs(config) or None, **agent_settings(config))
    if not protocol.tool:
        return GenerationConfig(
            max_start_length=int(data.max_start_length), max_prompt_length=int(data.max_prompt_length),
            max_response_length=int(data.max_response_length), search_url=config.retriever.url,
            stop=tuple(rollout.stop), **open_tag_settings(config), **common)
    multi_turn = rollout.multi_turn
    prompt, budget = int(data.max_prompt_length), int(data.max_response_length)
    # The search tool's url, topk and timeout replace retriever.*'s in GenerationConfig.__post_init__.
    return GenerationConfig(
        max_start_length=prompt, max_prompt_length=prompt + budget, max_response_length=budget,
        max_total_response_length=budget, protocol="tool", tool_config=protocol.tool_config.to_dict(),
        max_assistant_turns=multi_turn.max_assistant_turns, max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=int(multi_turn.max_parallel_calls),
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=str(multi_turn.tool_response_truncate_side), **common)
