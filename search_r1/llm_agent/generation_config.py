"""The generation manager's settings (`GenerationConfig`), checked when built.

Read by the manager (`generation.py`), by each protocol's turn rules (`tool_turns.py`) and by the
async loop on the rollout workers (it travels there as a dict in meta_info), so it lives apart
from all of them: none of them imports another to reach it. `generation.py` imports it, so
`from search_r1.llm_agent.generation import GenerationConfig` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass

from search_r1.llm_agent import actions, tools


@dataclass
class GenerationConfig:
    """Rollout settings; field names follow the original Search-R1 `GenerationConfig`.

    `num_gpus` is kept for compatibility only: the worker group pads batches that do
    not divide by its size, so the manager never pads by hand.
    `max_total_response_length` bounds all turns of a row together (None: bounded
    only by the turn count); a row that could not fit one more turn stops with
    reason `context_full`.
    """

    max_turns: int
    max_start_length: int
    max_prompt_length: int
    max_response_length: int
    max_obs_length: int
    num_gpus: int = 1
    no_think_rl: bool = False
    search_url: str | None = None
    topk: int = 3
    retrieval_timeout: float = 30.0
    retrieval_max_retries: int = 3
    stop: tuple[str, ...] = actions.STOP_STRINGS
    max_total_response_length: int | None = None
    # sync: one engine call per turn for all rows; async: one coroutine per trajectory in each
    # rollout worker (async_generation.py, docs/agent.md "Sync and async rollout").
    mode: str = "sync"
    # "tags": the original's <search>/<answer> text protocol (actions.py); "tool": native tool calls
    # through the chat template, veRL upstream's recipe (tools.py; multi_turn.enable). docs/agent.md.
    protocol: str = "tags"
    tool_config: dict | None = None            # tools.ToolConfig.to_dict() (plain types: it travels to workers)
    max_assistant_turns: int | None = None     # tool protocol: turns of the model (None: bounded by the budget)
    max_user_turns: int | None = None          # tool protocol: rounds of tool answers
    max_parallel_calls: int = 1                # tool calls run per turn; 1: the turn stops at </tool_call>
    max_tool_response_length: int | None = 256  # characters of one tool answer (veRL's default), then cut
    tool_response_truncate_side: str = "middle"
    # Requests in flight to the retrieval server per rollout worker in async mode (None: the client's default).
    retrieval_concurrency: int | None = None
    # retriever.serve=ray: the Ray Serve application that answers searches (replaces search_url and the
    # tool config's retrieval_service_url with ray-serve://<app>; search_r1/search/ray_serve.py).
    serve_app: str | None = None
    # Tag protocol: the second tag `<open> doc_id </open>` / `<open> doc_id page N </open>` (trainer key
    # open_tag.*; docs/agent.md "The open tag"). Off: everything is the original's, byte for byte.
    open_tag: bool = False
    max_opens: int = 2                 # opens one row may run (each also takes a turn of max_turns)
    open_page_size: int = 1000         # characters of one page of an opened document
    # veRL's multi_turn.interaction_config_path: simulated users (verl.interactions) answering a tool-protocol
    # row's turns without calls, for rows whose extra_info.interaction_kwargs names one (tool_turns.py).
    interaction_config_path: str | None = None
    # Agent loops (veRL's actor_rollout_ref.rollout.agent.*; search_r1/llm_agent/agent_loops.py): the loop of a
    # row without an `agent_name` (None: the protocol's own), the file registering loops by name, and the
    # trainer config as plain containers (a loop's `self.config`; it travels to the rollout workers).
    default_agent_loop: str | None = None
    agent_loop_config_path: str | None = None
    trainer_config: dict | None = None
    # openai_agent.*: the user's own agent through the OpenAI-compatible endpoint instead of the protocols'
    # loops (search_r1/llm_agent/openai_endpoint/rollout.py; docs/agent.md "Train an agent you already wrote").
    openai_agent: dict | None = None
    # data.apply_chat_template_kwargs (veRL's key): the chat template's variables (Qwen3's enable_thinking), so
    # the tool protocol's turns open the next assistant turn as the prompt opened the first.
    chat_template_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("tags", "tool"):
            raise ValueError(f"GenerationConfig.protocol must be 'tags' or 'tool', got {self.protocol!r}")
        if self.open_tag:
            self._check_open_tag()
        if self.protocol == "tool":
            self._check_tool_settings()
        if self.serve_app:
            from search_r1.search.ray_serve import serve_url

            self.search_url = serve_url(self.serve_app)
        if self.mode not in ("sync", "async"):
            raise ValueError(f"GenerationConfig.mode (actor_rollout_ref.rollout.mode) must be 'sync' or 'async', "
                             f"got {self.mode!r}")
        for name in ("max_start_length", "max_prompt_length", "max_response_length", "max_obs_length", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"GenerationConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < 0:
            raise ValueError(f"GenerationConfig.max_turns must be >= 0, got {self.max_turns}")
        if self.max_start_length >= self.max_prompt_length:
            raise ValueError(
                f"GenerationConfig.max_start_length ({self.max_start_length}) must be < max_prompt_length "
                f"({self.max_prompt_length}): the rolling context keeps the whole prompt plus recent turns"
            )
        if self.no_think_rl:
            raise ValueError(
                "GenerationConfig.no_think_rl (algorithm.no_think_rl) is not supported: it re-encodes "
                "decoded policy text, which breaks token-exact rollouts"
            )
        turn_budget = self.max_response_length + self.max_obs_length
        # (The tool protocol's budget is veRL's: all turns together; a turn may use all that is left.)
        if (self.protocol == "tags" and self.max_total_response_length is not None
                and self.max_total_response_length < turn_budget):
            raise ValueError(
                f"GenerationConfig.max_total_response_length ({self.max_total_response_length}) must fit one turn: "
                f"max_response_length + max_obs_length = {turn_budget}"
            )
        self.stop = tuple(self.stop)

    def _check_open_tag(self) -> None:
        from search_r1.search.documents import MAX_PAGE_SIZE

        if self.protocol != "tags":
            raise ValueError("GenerationConfig.open_tag (open_tag.enable) is the tag protocol's; with the tool protocol "
                             "declare an open tool in the tool config (multi_turn.tool_config_path)")
        if self.serve_app:
            raise ValueError("GenerationConfig.open_tag (open_tag.enable) needs the retrieval server over HTTP "
                             "(retriever.url, its POST /open); retriever.serve=ray is not supported with it")
        if not isinstance(self.max_opens, int) or self.max_opens < 1:
            raise ValueError(f"GenerationConfig.max_opens (open_tag.max_opens) must be an integer >= 1, "
                             f"got {self.max_opens!r}")
        if not isinstance(self.open_page_size, int) or not 1 <= self.open_page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"GenerationConfig.open_page_size (open_tag.page_size) must be an integer in "
                             f"[1, {MAX_PAGE_SIZE}], got {self.open_page_size!r}")
        # The engine stops at </open> as at </search> (an engine without stop strings is cut by position).
        if actions.SEARCH_CLOSE in self.stop and actions.OPEN_CLOSE not in self.stop:
            self.stop = (*self.stop, actions.OPEN_CLOSE)

    def _check_tool_settings(self) -> None:
        if not self.tool_config:
            raise ValueError("GenerationConfig.tool_config (multi_turn.tool_config_path) is required with protocol='tool'")
        if self.max_total_response_length is None:
            raise ValueError("GenerationConfig.max_total_response_length (data.max_response_length, the budget of all "
                             "turns) is required with protocol='tool'")
        for name in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"GenerationConfig.{name} (multi_turn.{name}) must be >= 1 or null, got {value}")
        if self.max_parallel_calls < 1:
            raise ValueError(f"GenerationConfig.max_parallel_calls (multi_turn.max_parallel_calls) must be >= 1, "
                             f"got {self.max_parallel_calls}")
        if self.tool_response_truncate_side not in tools.TRUNCATE_SIDES:
            raise ValueError(f"GenerationConfig.tool_response_truncate_side must be one of {tools.TRUNCATE_SIDES}, "
                             f"got {self.tool_response_truncate_side!r}")
        # One call a turn: stop the engine at its end (no compute after it). More: the turn runs to EOS.
        self.stop = (tools.TOOL_CALL_CLOSE,) if self.max_parallel_calls == 1 else ()
        # The search tool's own settings win over retriever.*: the tool config is what the recipe configures.
        search = tools.ToolConfig.from_dict(self.tool_config).search_settings()
        if search is not None:
            self.search_url = search.retrieval_service_url
            self.topk = int(search.topk)
            self.retrieval_timeout = float(search.timeout)
            if self.retrieval_concurrency is None:
                # veRL's num_workers / rate_limit cap the requests in flight over the whole job; split evenly
                # over the rollout workers (each runs its own client).
                cap = min(int(search.num_workers), int(search.rate_limit)) if search.enable_global_rate_limit \
                    else int(search.num_workers)
                self.retrieval_concurrency = max(1, cap // max(1, self.num_gpus))


__all__ = ["GenerationConfig"]
