"""The OpenAI endpoint's overhead: rollout tokens/s through it vs the tool protocol, same engine, model, rows.

Both roll out the offline demo's held-out questions in its tool world (its shipped tool warm start, its
BM25 server, temperature 0.8, three model turns, 512 response tokens a row) on the HF step engine (the
async rollout's continuous batching), in this process:

- `tool`: the tool protocol's async loop (`async_generation.run_shard`), one coroutine per row;
- `endpoint`: the plain-`openai` example agent (example/openai_agents/search_agent.py), one per row, each
  through its own session of the endpoint (HTTP, the `openai` SDK, rendering and merging included).

The two run alternately `--repeats` times; each run's tokens/s is the tokens the engine sampled over the
wall time. Prints one JSON object: `tool_tokens_per_s`, `endpoint_tokens_per_s` (medians), `ratio`
(endpoint / tool; the goal is >= 0.8), and the runs' figures. CPU wall times vary 2-3x with the load;
both sides run under the same load, interleaved.

    python -m scripts.bench.openai_endpoint                 # 32 rows, 2 repeats
    python -m scripts.bench.openai_endpoint --rows 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[2]
WARMSTART = REPO / "example" / "demo_warmstart_tool"
AGENT = REPO / "example" / "openai_agents" / "search_agent.py"
BUDGET, PROMPT, OBS, TOPK = 512, 640, 192, 2


def _engine(model: Any, tok: Any, rows: int) -> Any:
    from omegaconf import OmegaConf

    from verl.workers.rollout import HFRollout

    cfg = OmegaConf.create({"temperature": 0.8, "response_length": BUDGET, "micro_batch_size": max(8, rows)})
    meta = {"eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "do_sample": True,
            "stop": ["</tool_call>"]}
    return HFRollout(model, cfg, tok).step_engine(meta)


def run_tool(model: Any, tok: Any, frame: pd.DataFrame, tool_config: Any, seed: int) -> tuple[int, float]:
    """(tokens sampled, seconds) of the tool protocol's async rollout of the rows."""
    from search_r1.llm_agent.async_generation import run_shard
    from search_r1.llm_agent.generation import GenerationConfig
    from verl.utils.dataset.rl_dataset import prompt_to_text

    config = GenerationConfig(max_turns=2, max_start_length=PROMPT, max_prompt_length=PROMPT + BUDGET,
                              max_response_length=BUDGET, max_total_response_length=BUDGET, max_obs_length=OBS,
                              protocol="tool", tool_config=tool_config.to_dict(), max_assistant_turns=3,
                              max_tool_response_length=256, mode="async")
    prompts = [tok.encode(prompt_to_text(list(p), tok, tool_config.schemas), add_special_tokens=False)
               for p in frame["prompt"]]
    start = time.perf_counter()
    _, stats, _ = run_shard(tok, config, _engine(model, tok, len(prompts)), prompts, seed,
                            frozenset([tok.eos_token_id]))
    return sum(s["generated_tokens"] for s in stats), time.perf_counter() - start


def run_endpoint(model: Any, tok: Any, frame: pd.DataFrame, seed: int) -> tuple[int, float, dict]:
    """(tokens sampled, seconds, counters) of the example agent on every row through the endpoint."""
    from search_r1.llm_agent.openai_endpoint import agents
    from search_r1.llm_agent.openai_endpoint.engines import StepEngineClient
    from search_r1.llm_agent.openai_endpoint.server import Endpoint, EndpointLimits

    settings = agents.AgentSettings(path=str(AGENT), concurrency=len(frame), max_failure_fraction=1.0)
    endpoint = Endpoint(tok, StepEngineClient(_engine(model, tok, len(frame)), BUDGET),
                        EndpointLimits(max_prompt_length=PROMPT, max_response_length=BUDGET,
                                       max_concurrent_requests=2 * len(frame), call_seed=seed),
                        frozenset([tok.eos_token_id]))
    rows = agents.agent_rows([{"raw_prompt": [dict(m) for m in p]} for p in frame["prompt"]])
    start = time.perf_counter()
    results, counters = agents.run_agents(agents.load_agent(settings), endpoint, rows, settings)
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for r in results for s in r.samples for c, _, _ in s.turns)
    return tokens, seconds, dict(counters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.demo.build import DemoSettings, build_corpus_and_index, build_questions
    from scripts.demo.server import retrieval_server
    from scripts.demo.tool_demonstrations import write_tool_config
    from search_r1.llm_agent import tools

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_openai_endpoint_") as tmp:
        settings = DemoSettings(data_dir=tmp, output_dir=tmp, protocol="tool")
        corpus, index = build_corpus_and_index(settings)
        _, test_pq = build_questions(settings)
        frame = pd.read_parquet(test_pq).head(args.rows)
        tok = AutoTokenizer.from_pretrained(WARMSTART)
        model = AutoModelForCausalLM.from_pretrained(WARMSTART).eval()
        with retrieval_server(None, index, corpus, TOPK, Path(tmp) / "server.log") as url:
            os.environ["SEARCH_R1_RETRIEVAL_URL"] = url
            tool_config = tools.load_tool_config(write_tool_config(Path(tmp) / "tools.yaml", url, TOPK))
            runs: dict[str, list[dict]] = {"tool": [], "endpoint": []}
            with torch.no_grad():
                for repeat in range(args.repeats):
                    tokens, seconds = run_tool(model, tok, frame, tool_config, seed=repeat)
                    runs["tool"].append({"tokens": tokens, "seconds": round(seconds, 2),
                                         "tokens_per_s": round(tokens / seconds, 1)})
                    tokens, seconds, counters = run_endpoint(model, tok, frame, seed=repeat)
                    runs["endpoint"].append({"tokens": tokens, "seconds": round(seconds, 2),
                                             "tokens_per_s": round(tokens / seconds, 1),
                                             "failures": counters.get("failures", 0),
                                             "prefix_breaks": counters.get("prefix_breaks", 0)})
    tool = statistics.median(r["tokens_per_s"] for r in runs["tool"])
    endpoint = statistics.median(r["tokens_per_s"] for r in runs["endpoint"])
    print(json.dumps({"rows": len(frame), "repeats": args.repeats, "tool_tokens_per_s": tool,
                      "endpoint_tokens_per_s": endpoint, "ratio": round(endpoint / tool, 3), "goal": 0.8,
                      "load_average": os.getloadavg()[0], "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
