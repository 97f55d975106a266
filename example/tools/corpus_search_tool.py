"""A search tool of your own, written only against veRL's tool interface (`verl.tools.base_tool.BaseTool`):
BM25 (the `bm25s` package) over a local corpus file in the Search-R1 layout (`{"id", "contents":
"\"Title\"\ntext"}` per line), inside the rollout process: no retrieval server.

It answers `search(query_list)` as veRL's SearchTool lays its answer out (per query `Doc i (Title: ...)`
blocks joined by `\n---\n`, JSON-wrapped), so a model trained on the recipe's search reads it, and it
keeps a veRL-style reward per trajectory: `calc_reward` is 1.0 when a passage it returned contains a gold
answer (`create_kwargs.ground_truth`, which veRL's preprocess_search_r1_dataset.py writes into each row's
`extra_info.tools_kwargs.search`), else 0.0; a reward function may read it as
`extra_info["rollout_reward_scores"]["search"]`.

    bash train_grpo.sh demo.protocol=tool \
        actor_rollout_ref.rollout.multi_turn.tool_config_path=example/tools/corpus_search_tool.yaml
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from uuid import uuid4

import bm25s
import Stemmer

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score.search_r1_like_qa_em import subem_check
from verl.utils.rollout_trace import rollout_trace_op


class CorpusSearchTool(BaseTool):
    """`search` over the corpus at `config.corpus_path` (relative paths: from the working directory), `topk` hits
    per query (default 3)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        path = Path(config["corpus_path"]).expanduser()
        self.topk = int(config.get("topk", 3))
        self.passages = [json.loads(line)["contents"] for line in path.read_text().splitlines() if line.strip()]
        self.stemmer = Stemmer.Stemmer("english")
        self.bm25 = bm25s.BM25()
        self.bm25.index(self._tokens(self.passages), show_progress=False)
        self._found: dict[str, dict[str, Any]] = {}   # per trajectory: its gold answers, whether a hit held one

    def _tokens(self, texts: list[str]) -> Any:
        return bm25s.tokenize(texts, stopwords="en", stemmer=self.stemmer, show_progress=False)

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
                     ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        golds = ground_truth.get("target", []) if isinstance(ground_truth, dict) else ground_truth or []
        self._found[instance_id] = {"golds": [str(g) for g in ([golds] if isinstance(golds, str) else golds)],
                                    "found": False}
        return instance_id, ToolResponse()

    def _search(self, queries: list[str]) -> list[list[str]]:
        k = min(self.topk, len(self.passages))
        rows, _ = self.bm25.retrieve(self._tokens(queries), k=k, show_progress=False)
        return [[self.passages[int(i)] for i in row] for row in rows]

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        queries = parameters.get("query_list")
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            text = "Error: 'query_list' is missing, empty, or not a list in parameters."
            return ToolResponse(text=json.dumps({"result": text})), 0.0, {"bad_calls": 1}
        hits = await asyncio.to_thread(self._search, [q.strip() for q in queries])
        blocks = []
        for passages in hits:
            block = ""
            for i, contents in enumerate(passages, start=1):
                title, _, rest = contents.partition("\n")
                block += f"Doc {i} (Title: {title})\n{rest}\n\n"
            blocks.append(block.strip())
        state = self._found.get(instance_id)
        if state is not None and state["golds"] and any(subem_check(p, state["golds"]) for ps in hits for p in ps):
            state["found"] = True
        return ToolResponse(text=json.dumps({"result": "\n---\n".join(blocks)}, ensure_ascii=False)), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 1.0 if self._found.get(instance_id, {}).get("found") else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._found.pop(instance_id, None)
