"""Native tool calling, veRL upstream's Search-R1 recipe: pure functions on text, no tokens.

The model calls tools through its chat template (`<tool_call>{"name": "search", "arguments":
{"query_list": [...]}}</tool_call>`, the Hermes/Qwen format) and each call is answered by a
`tool` message that the same chat template renders. This module reads the recipe's tool
config (`search_tool_config.yaml`), parses a turn's tool calls, renders the search tool's
answer exactly as veRL's SearchTool writes it, and derives from the tokenizer's chat template
the text that goes between the model's turn and its next one. The generation manager is the
only place where that text becomes token ids (docs/agent.md, "Two protocols").

Departures from veRL's tool agent loop, on purpose:
- A malformed call (not JSON, no name, unknown tool, bad arguments) is answered by an error
  `tool` message and counted (`tool_call_errors`); veRL drops it silently and ends the row.
- The text between turns is what the chat template renders for the whole conversation,
  including the newline after the assistant's end-of-turn token, which veRL's
  system-prompt-stripping leaves out; so a rollout is the conversation an inference server
  would build.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from search_r1.search.schema import Hit

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# Bounds on the JSON a policy writes in a call (docs/agent.md "Hostile inputs"): past them the call is an
# error the model reads, not an exception (deep nesting is a RecursionError in json and in everything that
# later walks the value; an integer past Python's 4,300 digits a ValueError). No real call comes near them.
MAX_CALL_JSON_DEPTH = 32        # nested objects/arrays of a call (and again of an "arguments" string)
MAX_CALL_INT_DIGITS = 100       # digits of one JSON integer

# The tool classes a tool config may name; veRL's class path is the recipe's spelling.
SEARCH_TOOL_CLASSES = ("verl.tools.search_tool.SearchTool", "search_r1.llm_agent.tools.SearchTool")
# The keys of a search tool's `config:` block and what they mean here (docs/agent.md).
SEARCH_TOOL_KEYS = ("retrieval_service_url", "topk", "timeout", "num_workers", "rate_limit",
                    "enable_global_rate_limit", "type", "max_calls_per_row", "show_doc_ids")
TRUNCATE_SIDES = ("left", "right", "middle")
# multi_turn.format: the tool-call text format; veRL's recipe spells Hermes "qwen" (older name).
TOOL_FORMATS = ("hermes", "qwen")
# The name per-tool metrics count calls of tools that do not exist under (tools/<name>/...).
UNKNOWN_TOOL = "_unknown"

# veRL SearchTool's texts, byte for byte (its tool response is JSON {"result": text}).
NO_RESULTS_TEXT = "No search results found."
BAD_QUERY_LIST_TEXT = "Error: 'query_list' is missing, empty, or not a list in parameters."


@dataclass(frozen=True)
class SearchToolSettings:
    """A search tool's `config:` block (veRL SearchTool's keys, its defaults)."""

    retrieval_service_url: str
    topk: int = 3
    timeout: float = 30.0
    num_workers: int = 120      # concurrent requests to the retrieval server, per rollout worker
    rate_limit: int = 120       # requests in flight at once, per rollout worker
    enable_global_rate_limit: bool = True
    type: str = "native"
    show_doc_ids: bool = False  # each hit's header names its corpus id (for an `open` tool by doc_id)


@dataclass(frozen=True)
class ToolConfig:
    """A tool config file (`multi_turn.tool_config_path`): the schemas the chat template shows
    the model, and the settings of the tools that answer. Plain JSON types throughout, so it
    travels inside `GenerationConfig` to rollout workers."""

    schemas: list[dict] = field(default_factory=list)   # OpenAI function schemas, as written
    search: dict | None = None                           # SearchToolSettings as a dict
    source: str = ""
    others: list[dict] = field(default_factory=list)    # the other tools: {name, class_name, config}
    budgets: dict[str, int] = field(default_factory=dict)   # tool name -> max_calls_per_row

    @property
    def tool_names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    @property
    def search_name(self) -> str | None:
        """The name the model calls the search tool by (the schema's `function.name`)."""
        return None if self.search is None else self.search["name"]

    def search_entry(self) -> dict:
        """The search tool as a `{name, class_name, config}` entry (verl.tools.search_tool.SearchTool)."""
        if self.search is None:
            raise ValueError(f"{self.source}: no search tool is configured")
        config = {k: v for k, v in self.search.items() if k != "name"}
        return {"name": self.search["name"], "class_name": SEARCH_TOOL_CLASSES[0], "config": config}

    def search_settings(self) -> SearchToolSettings | None:
        if self.search is None:
            return None
        return SearchToolSettings(**{k: v for k, v in self.search.items() if k != "name"})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolConfig:
        return cls(schemas=[dict(s) for s in data.get("schemas", [])], search=data.get("search"),
                   source=str(data.get("source", "")), others=[dict(o) for o in data.get("others", [])],
                   budgets={str(k): int(v) for k, v in (data.get("budgets") or {}).items()})


def _plain(value: Any) -> Any:
    """OmegaConf / YAML values as plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    return value


def _add_schema(schemas: list[dict], schema: Any, where: str) -> None:
    """Check one OpenAI function schema and append it; a name defined twice is refused."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.tool_schema: expected {{type: function, function: {{name: ..., "
                         f"description: ..., parameters: ...}}}}")
    if schema.get("type", "function") != "function":
        raise ValueError(f"{where}.tool_schema.type: only 'function' tools are supported, got {schema['type']!r}")
    name = function["name"]
    if name in [s["function"]["name"] for s in schemas]:
        raise ValueError(f"{where}.tool_schema.function.name: tool {name!r} is defined twice")
    schemas.append(schema)


def _other_tools(class_name: Any, config: dict, schema: Any, where: str,
                 base_dir: str | Path | None = None) -> list[tuple[dict, dict]]:
    """({name, class_name, config}, schema) of each tool a non-search entry declares (an MCP entry
    declares its server's tools, their schemas listed from the server unless tool_schema is given;
    any other class is a `verl.tools.base_tool.BaseTool` of the user's, `_user_tool`)."""
    from search_r1.llm_agent import tool_backends

    if class_name not in tool_backends.BACKENDS:
        return [_user_tool(class_name, config, schema, where, base_dir)]
    tool_backends.check_config(class_name, config, where)
    if class_name.endswith(".MCPTool"):
        from search_r1.llm_agent import mcp_tools

        listed = mcp_tools.list_tool_schemas(config, where) if schema is None else [schema]
        return [({"name": s["function"]["name"], "class_name": class_name, "config": config}, s) for s in listed]
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"{where}.tool_schema: expected {{type: function, function: {{name: ..., "
                         f"description: ..., parameters: ...}}}}")
    return [({"name": name, "class_name": class_name, "config": config}, schema)]


def _user_tool(class_name: Any, config: dict, schema: Any, where: str,
               base_dir: str | Path | None) -> tuple[dict, dict]:
    """A tool class of the user's: importable here (a dotted name, or `path/to/file.py:Class`, relative to
    the tool config's folder), a BaseTool, `config.type` native; its schema from the YAML, else from the
    class (`get_openai_tool_schema()` of an instance built without one, as veRL allows)."""
    from search_r1.llm_agent.tool_results import as_schema
    from verl.tools.base_tool import BaseTool
    from verl.tools.utils.tool_registry import ToolClassError, get_tool_class, resolve_class_name

    if not isinstance(class_name, str):
        raise ValueError(f"{where}.class_name: expected a class (my_module.MyTool or path/to/file.py:MyTool), "
                         f"got {class_name!r}")
    builtins = list(SEARCH_TOOL_CLASSES) + tool_backends_names()
    resolved = resolve_class_name(class_name, base_dir)
    try:
        cls = get_tool_class(resolved, f"{where}.class_name")
    except ToolClassError as err:
        raise ValueError(f"{where}.class_name: {class_name!r} is not a tool this project can load ({err.reason}); "
                         f"built-in tools: {builtins}") from err
    if not issubclass(cls, BaseTool):
        raise ValueError(f"{where}.class_name: {class_name!r} is not a tool this project can load: not a "
                         f"verl.tools.base_tool.BaseTool subclass; built-in tools: {builtins}")
    kind = config.get("type", "native")
    if kind != "native":
        raise ValueError(f"{where}.config.type: only 'native' tools load by class_name here, got {kind!r} (an MCP "
                         "server's tools: class_name search_r1.llm_agent.mcp_tools.MCPTool)")
    if schema is None:
        try:
            given = cls(config=dict(config), tool_schema=None).get_openai_tool_schema()
            schema = given.model_dump(exclude_unset=True, exclude_none=True) if hasattr(given, "model_dump") else given
        except Exception as err:   # noqa: BLE001 - the class could not give one: the YAML must
            raise ValueError(f"{where}.tool_schema: required ({class_name} gives no schema of its own: "
                             f"{type(err).__name__}: {err})") from err
    try:
        name = as_schema(schema).function.name
    except ValueError as err:
        raise ValueError(f"{where}.tool_schema: not an OpenAI function tool ({err})") from err
    return {"name": name, "class_name": resolved, "config": config}, schema


def tool_backends_names() -> list[str]:
    from search_r1.llm_agent import tool_backends

    return list(tool_backends.BACKENDS)


def parse_tool_config(data: Any, source: str = "<tool config>", base_dir: str | Path | None = None) -> ToolConfig:
    """Validate a tool config (the YAML's content) and return it; errors name `source` and the key.
    `base_dir`: where a tool class's relative file path is read from (the YAML's folder)."""
    data = _plain(data)
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ValueError(f"{source}: expected a top-level 'tools:' list with at least one tool")
    schemas: list[dict] = []
    search: dict | None = None
    others: list[dict] = []
    budgets: dict[str, int] = {}
    for i, tool in enumerate(data["tools"]):
        where = f"{source}: tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: expected a mapping with class_name, config and tool_schema")
        unknown = sorted(set(tool) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: class_name, config, tool_schema")
        class_name = tool.get("class_name")
        config = tool.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config: expected a mapping")
        if class_name not in SEARCH_TOOL_CLASSES:
            for entry, schema in _other_tools(class_name, config, tool.get("tool_schema"), where, base_dir):
                _add_schema(schemas, schema, where)
                budget = config.get("max_calls_per_row")
                if budget is not None:
                    budgets[entry["name"]] = int(budget)
                others.append(entry)
            continue
        schema = tool.get("tool_schema")
        _add_schema(schemas, schema, where)
        name = schema["function"]["name"]
        if search is not None:
            raise ValueError(f"{where}: only one search tool may be configured (also {search['name']!r})")
        config = dict(config)
        unknown = sorted(set(config) - set(SEARCH_TOOL_KEYS))
        if unknown:
            raise ValueError(f"{where}.config: unknown keys {unknown}; known: {list(SEARCH_TOOL_KEYS)}")
        budget = config.pop("max_calls_per_row", None)
        if budget is not None:
            if not isinstance(budget, int) or budget < 1:
                raise ValueError(f"{where}.config.max_calls_per_row: must be an integer >= 1, got {budget!r}")
            budgets[name] = budget
        if not config.get("retrieval_service_url"):
            raise ValueError(f"{where}.config.retrieval_service_url: required (the retrieval server's "
                             f"/retrieve URL, e.g. http://127.0.0.1:8000/retrieve)")
        if config.get("type", "native") != "native":
            raise ValueError(f"{where}.config.type: only 'native' is supported, got {config['type']!r}")
        settings = SearchToolSettings(**config)
        for key in ("topk", "num_workers", "rate_limit"):
            if int(getattr(settings, key)) < 1:
                raise ValueError(f"{where}.config.{key}: must be >= 1, got {getattr(settings, key)}")
        if float(settings.timeout) <= 0:
            raise ValueError(f"{where}.config.timeout: must be > 0, got {settings.timeout}")
        search = {"name": name, **asdict(settings)}
    return ToolConfig(schemas=schemas, search=search, source=source, others=others, budgets=budgets)


def load_tool_config(path: str | Path) -> ToolConfig:
    """Read `multi_turn.tool_config_path` (veRL's YAML layout; see example/tool_recipe/)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: no file {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from err
    return parse_tool_config(data, source=str(path), base_dir=path.resolve().parent)


# --- a turn's tool calls ------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a configured tool."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    """A call that cannot run; `message` is the error the model reads in the tool message."""

    message: str
    tool: str | None = field(default=None, compare=False)   # the tool it named, if any (per-tool metrics)


class _BadJSON(ValueError):
    """A call's JSON that is refused; the message is the reason the model reads."""


def _too_deep(text: str, limit: int) -> bool:
    """True when `text`'s objects/arrays nest deeper than `limit` (outside strings), in one linear pass.
    Counted before json.loads so a deep value is refused without recursing into it."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth = max(0, depth - 1)
    return False


def _refuse_constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not a JSON number")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_CALL_INT_DIGITS:
        raise _BadJSON(f"an integer of more than {MAX_CALL_INT_DIGITS} digits")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadJSON(f"a number out of range ({text[:20]}...)")
    return value


def _loads(text: str) -> Any:
    """Strict, bounded JSON: raises _BadJSON (a ValueError) with the reason for anything refused,
    never RecursionError or int's digit-limit ValueError."""
    if _too_deep(text, MAX_CALL_JSON_DEPTH):
        raise _BadJSON("nested too deeply")
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_refuse_constant)
    except _BadJSON:
        raise
    except json.JSONDecodeError as err:
        raise _BadJSON(err.msg) from err
    except RecursionError as err:     # unreachable past _too_deep; kept so no input can escape as one
        raise _BadJSON("nested too deeply") from err
    except ValueError as err:         # e.g. a float literal float() refuses
        raise _BadJSON(str(err)[:200]) from err


def _call_bodies(text: str) -> list[str]:
    """The body of every complete `<tool_call>…</tool_call>`, in order (each the shortest, as a lazy
    regex finds them), found with str.find: linear, where a regex rescans the rest of the text from
    every unclosed opening."""
    bodies = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:          # no later opening is closed either
            break
        bodies.append(text[start + len(TOOL_CALL_OPEN): end])
        pos = end + len(TOOL_CALL_CLOSE)
    return bodies


def outside_reasoning(text: str) -> str:
    """`text` without its reasoning, as Qwen3's reasoning parser reads a turn: each `<think>…</think>`
    span dropped, an unclosed `<think>` drops the rest (the model is still thinking), and a `</think>`
    before any `<think>` (a template that opens the reasoning in the prompt) drops what precedes it.
    The kept pieces are joined by newlines, so no tag forms across a dropped span. Linear (str.find)."""
    first_close, first_open = text.find(THINK_CLOSE), text.find(THINK_OPEN)
    pos = first_close + len(THINK_CLOSE) if first_close >= 0 and (first_open < 0 or first_close < first_open) else 0
    kept = []
    while (start := text.find(THINK_OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            return "\n".join(kept)
        pos = end + len(THINK_CLOSE)
    kept.append(text[pos:])
    return "\n".join(kept)


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> list[ToolCall | ToolCallError]:
    """Every complete `<tool_call>…</tool_call>` in `text` outside its reasoning (`outside_reasoning`: a
    call a thinking model drafts inside `<think>…</think>` is not made), in order, parsed; an unclosed
    one is not a call.

    The body must be a JSON object with a string `name` of a configured tool and an object
    `arguments` (a JSON string holding an object is accepted too, as some models write it).
    Never raises for any text: a call that cannot be read (not JSON, past MAX_CALL_JSON_DEPTH or
    MAX_CALL_INT_DIGITS, NaN/Infinity) is a ToolCallError saying why.
    """
    calls: list[ToolCall | ToolCallError] = []
    for body in _call_bodies(outside_reasoning(text)):
        try:
            obj = _loads(body)
        except _BadJSON as err:
            calls.append(ToolCallError(f"Error: the tool call is not valid JSON ({err}); write "
                                       f'{{"name": <tool name>, "arguments": {{...}}}} inside <tool_call></tool_call>.'))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str):
            calls.append(ToolCallError('Error: the tool call must be a JSON object with a string "name" and an '
                                       'object "arguments".'))
            continue
        if name not in tool_names:
            calls.append(ToolCallError(f"Error: unknown tool {name!r}; available tools: {list(tool_names)}.",
                                       tool=UNKNOWN_TOOL))
            continue
        arguments = obj.get("arguments", {})
        reason = ""
        if isinstance(arguments, str):
            try:
                arguments = _loads(arguments)
            except _BadJSON as err:
                arguments, reason = None, "" if isinstance(err.__cause__, json.JSONDecodeError) else f" ({err})"
        if not isinstance(arguments, dict):
            calls.append(ToolCallError(f'Error: the "arguments" of tool {name!r} must be a JSON object{reason}.',
                                       tool=name))
            continue
        calls.append(ToolCall(name=name, arguments=arguments))
    return calls


def has_answer(text: str) -> bool:
    """True when `text` holds a complete `<answer>…</answer>` (str.find: linear in the text)."""
    start = text.find(ANSWER_OPEN)
    return start >= 0 and text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN)) >= 0


def search_queries(call: ToolCall) -> list[str] | None:
    """The queries of a search call, or None when `query_list` is not a non-empty list of
    non-empty strings (veRL asks only for a non-empty list; an empty or non-string query would
    fail the server's whole request, so it is an argument error here)."""
    queries = call.arguments.get("query_list")
    if not isinstance(queries, list) or not queries:
        return None
    if not all(isinstance(q, str) and q.strip() for q in queries):
        return None
    return [q.strip() for q in queries]


def tool_result(text: str) -> str:
    """A tool's answer as veRL's SearchTool wraps it: JSON `{"result": text}`, non-ASCII kept."""
    return json.dumps({"result": text}, ensure_ascii=False)


def render_passages(hits: Sequence[Hit], show_doc_ids: bool = False) -> str:
    """One query's hits as veRL's search tool writes them: `Doc i (Title: first line)\\nrest` per
    hit, blank-line separated (note the space before `(`, unlike the tag protocol's `Doc i(`)."""
    out = ""
    for i, hit in enumerate(hits, start=1):
        title, _, rest = hit.contents.partition("\n")
        doc = f" [doc_id: {hit.doc_id}]" if show_doc_ids else ""
        out += f"Doc {i} (Title: {title}){doc}\n{rest}\n\n"
    return out.strip()


def render_search_results(results: Sequence[Sequence[Hit]], show_doc_ids: bool = False) -> str:
    """The search tool's answer to one call: each query's passages, joined by `\\n---\\n`, wrapped."""
    if not results:
        return tool_result(NO_RESULTS_TEXT)
    return tool_result("\n---\n".join(render_passages(hits, show_doc_ids) for hits in results))


def render_search_error(message: str) -> str:
    """The search tool's answer when the retrieval server could not answer."""
    return tool_result(f"Search error: {message}")


def render_call_error(error: ToolCallError) -> str:
    return tool_result(error.message)


def render_bad_query_list() -> str:
    return tool_result(BAD_QUERY_LIST_TEXT)


def truncate_tool_response(text: str, max_length: int | None, side: str = "middle") -> tuple[str, bool]:
    """veRL's `max_tool_response_length` (characters) and `tool_response_truncate_side`:
    left keeps the start, right the end, middle both halves. Returns (text, truncated)."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"multi_turn.tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if not max_length or len(text) <= max_length:
        return text, False
    if side == "left":
        return text[:max_length] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-max_length:], True
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:], True


# --- the chat template's text between turns ---------------------------------------------------

_SENTINEL = "\x00SEARCH_R1_SENTINEL\x00"


class ChatFraming:
    """What the tokenizer's chat template writes between the model's turn and its next one.

    Found by rendering a small conversation with and without tool messages, so any template
    that renders `tool` messages after an assistant message as an appendix works (Qwen2.5,
    Llama-3.1, the demo's). `observation(texts, ended_with_eos)` is the assistant's
    end-of-turn (unless the model already wrote it), the tool messages, and the generation
    prompt of the next assistant turn.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        # chat_template_kwargs: data.apply_chat_template_kwargs (veRL's key), e.g. Qwen3's enable_thinking,
        # so the next assistant turn opens as the prompt's did.
        self._template_kwargs = dict(chat_template_kwargs or {})
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tool calling (multi_turn.enable) needs a tokenizer with a chat template that renders "
                             f"tools and 'tool' messages; {getattr(tokenizer, 'name_or_path', tokenizer)!r} has none")
        self._tokenizer = tokenizer
        self._tools = list(tools) if tools else None
        base = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}], False)
        if base.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render an assistant message's content once, verbatim")
        self.assistant_end = base[base.index(_SENTINEL) + len(_SENTINEL):]
        self._base = base
        eos = getattr(tokenizer, "eos_token", None)
        self._eos_text = eos if isinstance(eos, str) else ""
        probe = self.tool_block([_SENTINEL])
        if _SENTINEL not in probe:
            raise ValueError("the chat template does not render 'tool' messages (role 'tool'); tool calling needs one "
                             "that does (e.g. Qwen2.5's)")

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(messages, tools=self._tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **self._template_kwargs)

    def tool_block(self, texts: Sequence[str], role: str = "tool") -> str:
        """The tool messages (`role`: or an interaction's `user` message) and the next assistant turn's
        opening, as rendered after an assistant turn."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        full = self._render(messages + [{"role": role, "content": t} for t in texts], True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow it; "
                             "tool observations cannot be appended token-exactly")
        return full[len(self._base):]

    def observation(self, texts: Sequence[str], ended_with_eos: bool, role: str = "tool") -> str:
        """Text appended after a turn that called tools: end of the assistant turn, the tool
        messages, the next assistant opening. A turn that already ended with the EOS token
        (the template's end-of-turn token) is not given a second one."""
        end = self.assistant_end
        if ended_with_eos and self._eos_text and end.startswith(self._eos_text):
            end = end[len(self._eos_text):]
        return end + self.tool_block(texts, role)

    def split_observation(self, texts: Sequence[str], ended_with_eos: bool, role: str = "tool"
                          ) -> list[tuple[str, bool]]:
        """`observation` cut into pieces, each (text, is_tool_content), so the caller can shorten
        the tool contents and keep the framing (the closing tags and the next turn's opening)."""
        marked = self.observation([f"{_SENTINEL}{i}{_SENTINEL}" for i in range(len(texts))], ended_with_eos, role)
        pieces: list[tuple[str, bool]] = []
        parts = marked.split(_SENTINEL)
        # parts: framing, "0", framing, "1", ..., framing
        for j, part in enumerate(parts):
            if j % 2 == 1:
                pieces.append((texts[int(part)], True))
            elif part:
                pieces.append((part, False))
        return pieces


__all__ = [
    "BAD_QUERY_LIST_TEXT", "MAX_CALL_INT_DIGITS", "MAX_CALL_JSON_DEPTH", "NO_RESULTS_TEXT", "SEARCH_TOOL_CLASSES", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN",
    "THINK_CLOSE", "THINK_OPEN", "TOOL_FORMATS", "TRUNCATE_SIDES", "UNKNOWN_TOOL", "ChatFraming", "SearchToolSettings", "ToolCall", "ToolCallError",
    "ToolConfig", "has_answer", "load_tool_config", "parse_tool_config", "parse_tool_calls", "render_bad_query_list",
    "outside_reasoning", "render_call_error", "render_passages", "render_search_error", "render_search_results", "search_queries",
    "tool_result", "truncate_tool_response",
]
