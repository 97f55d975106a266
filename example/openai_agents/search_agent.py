"""A search agent written against the OpenAI API with plain `openai` calls: it asks the model, runs the
`search` calls the model makes against a Search-R1 retrieval server itself, and returns the answer.

It is an ordinary agent: pointed at any OpenAI-compatible server it runs as it is. Trained here
(docs/agent.md "Train an agent you already wrote"), the trainer calls `agent(base_url, row)` once per row
with `base_url` the row's own session on the rollout engine's endpoint; the three lines that make an
existing agent trainable are marked `# <- trained`.

    openai_agent.path=example/openai_agents/search_agent.py     # the trainer's keys
    bash train_grpo.sh demo.agent=openai                         # the offline demo with this agent

The retrieval server is `SEARCH_R1_RETRIEVAL_URL` (default http://127.0.0.1:8000/retrieve). The tool
schema, the answer's rendering (veRL SearchTool's text, cut to 256 characters) and the three model turns
are the demo's tool protocol's, so the demo's tool warm start reads what it was taught.
"""

from __future__ import annotations

import json
import os
import re

import httpx
from openai import AsyncOpenAI

SEARCH_TOOL = {
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
MAX_TURNS = 3            # model turns: two searches and the answer
TOPK = 2
MAX_RESULT_CHARS = 256   # a tool answer longer than this keeps its first and last 128 characters
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def render_results(results: list[list[dict]]) -> str:
    """Each query's passages as `Doc i (Title: first line)\\nrest`, queries joined by `\\n---\\n`, JSON-wrapped."""
    blocks = []
    for hits in results:
        docs = []
        for i, hit in enumerate(hits, start=1):
            title, _, rest = hit["document"]["contents"].partition("\n")
            docs.append(f"Doc {i} (Title: {title})\n{rest}\n\n")
        blocks.append("".join(docs).strip())
    text = json.dumps({"result": "\n---\n".join(blocks) if results else "No search results found."},
                      ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        half = MAX_RESULT_CHARS // 2
        text = text[:half] + "...(truncated)..." + text[len(text) - half:]
    return text


async def search(http: httpx.AsyncClient, arguments: str) -> str:
    try:
        queries = json.loads(arguments).get("query_list")
    except (ValueError, AttributeError):
        queries = None
    if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
        return json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list in parameters."})
    url = os.environ.get("SEARCH_R1_RETRIEVAL_URL", "http://127.0.0.1:8000/retrieve")
    try:
        answer = await http.post(url, json={"queries": [q.strip() for q in queries], "topk": TOPK,
                                            "return_scores": True}, timeout=30)
        answer.raise_for_status()
        return render_results(answer.json()["result"])
    except (httpx.HTTPError, ValueError, KeyError) as err:
        return json.dumps({"result": f"Search error: {type(err).__name__}"})


async def agent(base_url: str, row: dict) -> dict:
    """Answer the row's question (its chat messages: `row["raw_prompt"]`), searching when the model asks."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused")       # <- trained: the base_url it is given
    messages = [dict(m) for m in row["raw_prompt"]]                   # <- trained: the row's question
    content = ""
    async with client, httpx.AsyncClient() as http:
        for turn in range(MAX_TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            content = message.content or ""
            if not message.tool_calls or turn == MAX_TURNS - 1:   # the last turn's calls are not run
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await search(http, call.function.arguments)})
    found = ANSWER.findall(content)
    return {"answer": found[-1].strip() if found else None, "turns": turn + 1}   # <- trained: a dict back
