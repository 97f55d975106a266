"""The demo in the tool protocol (veRL upstream's Search-R1 recipe): its chat template, search
tool, prompt and SFT demonstrations, rendered by the functions the rollout uses.

A rollout in the tool protocol (docs/agent.md, "Two protocols") is the chat template over
[system, user] with the search tool's schema (`tools=`), then policy turns that end at
`</tool_call>`, each answered by a `tool` message that the same template renders (the text
`search_r1.llm_agent.tools.ChatFraming.observation` derives), and a last turn with the answer
and EOS. The demonstrations here are written in exactly that text: the observation is
`ChatFraming(...).observation([truncate_tool_response(render_search_results(hits))])`, so the
warm start practises on what RL will show it.

The demo's tokenizer is the tag demo's (example/demo_warmstart/tokenizer.json, trained on
tag-protocol text); the tool warm start continues the tag warm start's SFT on these
demonstrations, so it keeps the vocabulary and gets this module's chat template.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scripts.data_process.common import TOOL_SYSTEM_CONTENT, TOOL_USER_CONTENT_PREFIX
from scripts.demo.demonstrations import (
    DEFAULT_GUESS_SHARE,
    DEFAULT_KIND_WEIGHTS,
    Turn,
    WorldSearch,
    make_demonstrations,
)
from scripts.demo.world import Question, World
from search_r1.llm_agent import tools

# Qwen2.5's layout, shorter: a system turn listing the tools (after the system message, if
# any), ChatML turns, and consecutive `tool` messages in one user turn, each inside
# <tool_response></tool_response>. Without tools and without a system message it renders what
# the tag demo's template renders, so the tag warm start's turns read the same.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write <tool_call>\\n{\"name\": <name>, \"arguments\": <JSON object>}\\n"
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# veRL's examples/data_preprocess/preprocess_search_r1_dataset.py: the system message and the
# user prefix its rows carry (the question follows the prefix), as scripts/data_process writes them.
SYSTEM_CONTENT = TOOL_SYSTEM_CONTENT
USER_CONTENT_PREFIX = TOOL_USER_CONTENT_PREFIX

# The recipe's search tool schema (veRL's search_tool_config.yaml, `item` spelling included),
# so the demo's model reads the schema a recipe run shows.
SEARCH_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "item": {"type": "string"},
                    "description": "A list of fully-formed semantic queries. The tool will return search "
                                   "results for each query.",
                },
            },
            "required": ["query_list"],
        },
    },
}
# veRL's default multi_turn.max_tool_response_length (characters) and truncation side; the
# demo's two passages fit in it (checked when the demonstrations are written).
MAX_TOOL_RESPONSE_LENGTH = 256
TOOL_RESPONSE_TRUNCATE_SIDE = "middle"


def tool_config(url: str, topk: int) -> dict:
    """The demo's tool config (veRL's YAML layout), answering from the retrieval server at `url`."""
    return {"tools": [{
        "class_name": "verl.tools.search_tool.SearchTool",
        "config": {"retrieval_service_url": url, "topk": topk, "timeout": 30, "num_workers": 120,
                   "rate_limit": 120, "type": "native"},
        "tool_schema": SEARCH_TOOL_SCHEMA,
    }]}


def write_tool_config(path: Path, url: str, topk: int) -> Path:
    """Write `tool_config(url, topk)` as YAML at `path` (what multi_turn.tool_config_path reads)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tool_config(url, topk), sort_keys=False))
    tools.load_tool_config(path)   # fail here, naming the file, rather than in a rollout worker
    return path


def user_content(question: str) -> str:
    return USER_CONTENT_PREFIX.rstrip("\n") + question


def prompt_messages(question: str) -> list[dict]:
    """[system, user] as veRL's preprocess writes a row's `prompt`."""
    return [{"role": "system", "content": SYSTEM_CONTENT}, {"role": "user", "content": user_content(question)}]


def with_tool_template(tokenizer: Any) -> Any:
    """`tokenizer` with the tool protocol's chat template (the object is changed and returned)."""
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def render_prompt(tokenizer: Any, question: str) -> str:
    """The rollout's first text: the chat template over [system, user] with the tool schema."""
    return tokenizer.apply_chat_template(prompt_messages(question), tools=[SEARCH_TOOL_SCHEMA], tokenize=False,
                                         add_generation_prompt=True)


def tool_query(hop: str) -> str:
    """The query a demonstration sends for the entity `hop`: "about <hop>".

    The leading word keeps the name's tokenization: byte-level BPE splits `"Eldriqui` into `"`,
    `El`, `dri`, … but ` Eldriqui` (after a space, as in the question and in the passages) into
    `ĠEl`, `dri`, …, so after "about " the model copies the pieces it read, the skill the tag warm
    start already has. "about" is an English stop word, so BM25 finds what the bare name finds."""
    return f"about {hop}"


def search_call(hop: str) -> str:
    """A policy turn that calls the search tool for `hop`; it ends where the engine stops (`</tool_call>`)."""
    call = json.dumps({"name": "search", "arguments": {"query_list": [tool_query(hop)]}}, ensure_ascii=False)
    return f"<think> I need to search {hop}. </think>\n{tools.TOOL_CALL_OPEN}\n{call}\n{tools.TOOL_CALL_CLOSE}"


def answer_text(answer: str, searched: bool) -> str:
    """The last policy turn (the SFT trainer appends EOS, as the model writes it in a rollout)."""
    thought = "I found it." if searched else "I know it."
    return f"<think> {thought} </think>\n<answer> {answer} </answer>"


def tool_response(hits: Sequence) -> str:
    """One search call's tool message content, as the rollout writes it (veRL's text, truncated
    to max_tool_response_length)."""
    text, truncated = tools.truncate_tool_response(tools.render_search_results([hits]), MAX_TOOL_RESPONSE_LENGTH,
                                                   TOOL_RESPONSE_TRUNCATE_SIDE)
    if truncated:
        # The demo's passages are short; a truncated one would teach copying from a cut text.
        raise ValueError(f"a demo tool response is longer than {MAX_TOOL_RESPONSE_LENGTH} characters "
                         f"({len(tools.render_search_results([hits]))}): raise MAX_TOOL_RESPONSE_LENGTH")
    return text


def searched_trajectory(question: Question, search: WorldSearch, topk: int, framing: tools.ChatFraming) -> list[Turn]:
    turns = []
    for hop in question.hops:
        turns.append(Turn("policy", search_call(hop)))
        # The engine stopped at </tool_call>, so the turn did not end with EOS.
        turns.append(Turn("observation", framing.observation([tool_response(search.search([tool_query(hop)], topk)[0])],
                                                             ended_with_eos=False)))
    turns.append(Turn("policy", answer_text(question.answer, searched=True)))
    return turns


def guessed_trajectory(question: Question, world: World, rng: random.Random) -> list[Turn]:
    candidates = [e for e in world.entities_of_type(question.answer_type) if e != question.answer]
    return [Turn("policy", answer_text(rng.choice(candidates), searched=False))]


def make_tool_demonstrations(
    worlds: Sequence[World],
    n_total: int,
    topk: int,
    seed: int,
    framing: tools.ChatFraming,
    guess_share: Mapping[str, float] = DEFAULT_GUESS_SHARE,
    kind_weights: Mapping[str, float] = DEFAULT_KIND_WEIGHTS,
) -> list[tuple[Question, list[Turn]]]:
    """`n_total` (question, trajectory) pairs in the tool protocol, drawn as the tag demo draws
    them (same kinds, weights and guess shares: the gap RL closes)."""
    return make_demonstrations(
        worlds, n_total, topk, seed, guess_share, kind_weights,
        searched=lambda question, search, k: searched_trajectory(question, search, k, framing),
        guessed=guessed_trajectory)


def framing_for(tokenizer: Any) -> tools.ChatFraming:
    """The rollout's ChatFraming for the demo's tokenizer and search tool."""
    return tools.ChatFraming(tokenizer, [SEARCH_TOOL_SCHEMA])


def tool_text_fingerprint() -> str:
    """sha256 of the tool protocol's text that is not in DemoSettings: chat template, system and
    user prompt, tool schema, tool-response rendering and truncation, the call's spelling. The
    tool warm start's demonstrations were written in it, so a change makes the shipped weights stale."""
    from search_r1.search.schema import Hit

    sample = [Hit.from_contents("0", '"Title"\nbody one\nbody two', 1.0), Hit.from_contents("1", "bare", 0.5)]
    text = "\x00".join([
        TOOL_CHAT_TEMPLATE, SYSTEM_CONTENT, USER_CONTENT_PREFIX, json.dumps(SEARCH_TOOL_SCHEMA, sort_keys=True),
        tools.render_search_results([sample, sample]), tools.render_search_results([]),
        tools.truncate_tool_response("x" * 300, MAX_TOOL_RESPONSE_LENGTH, TOOL_RESPONSE_TRUNCATE_SIDE)[0],
        search_call("q"), answer_text("a", True), answer_text("a", False),
    ])
    return hashlib.sha256(text.encode()).hexdigest()
