"""The search agent written with an agent framework from PyPI, smolagents (`pip install -e ".[agents]"`):
a `ToolCallingAgent` with a `search` tool over a Search-R1 retrieval server, its model an
`OpenAIServerModel` pointed at the `base_url` the trainer gives (the one line that makes it trainable).

smolagents is synchronous and keeps its own memory: it re-renders the conversation in its own way at
every step (tool results as user messages), so its completions break the prefix chain and each becomes a
training sample of its own sharing the row's reward (agent/prefix_breaks counts them; docs/agent.md).

    openai_agent.path=example/openai_agents/smolagents_agent.py
"""

from __future__ import annotations

import asyncio
import os

MAX_STEPS = 2
SYSTEM_PROMPT = ("Answer the question. Call the search tool to look things up, then give the answer with "
                 "final_answer.")


def _build(base_url: str):
    import httpx
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent
    from smolagents.agents import EMPTY_PROMPT_TEMPLATES

    class Search(Tool):
        name = "search"
        description = "Searches a corpus for passages about the query."
        inputs = {"query": {"type": "string", "description": "what to look up"}}
        output_type = "string"

        def forward(self, query: str) -> str:
            url = os.environ.get("SEARCH_R1_RETRIEVAL_URL", "http://127.0.0.1:8000/retrieve")
            answer = httpx.post(url, json={"queries": [query], "topk": 2, "return_scores": True}, timeout=30)
            answer.raise_for_status()
            return "\n".join(hit["document"]["contents"] for hit in answer.json()["result"][0])

    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key="unused")   # <- trained
    templates = {**EMPTY_PROMPT_TEMPLATES, "system_prompt": SYSTEM_PROMPT}
    return ToolCallingAgent(tools=[Search()], model=model, max_steps=MAX_STEPS, prompt_templates=templates,
                            verbosity_level=0)


async def agent(base_url: str, row: dict) -> dict:
    question = row["raw_prompt"][-1]["content"]
    answer = await asyncio.to_thread(lambda: _build(base_url).run(question))   # smolagents blocks: a thread
    return {"answer": None if answer is None else str(answer)}
