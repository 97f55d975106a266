"""How fast the trajectory viewer's page opens on a big run: synthetic dumps of N trajectories
(Search-R1-sized: a prompt, two searches with two retrieved passages each, an answer; per-token
pieces, advantages and log-probs), the page built from them, opened in headless Chromium.

    python -m scripts.bench.viewer_load                      # 10,000 trajectories (20 steps x 500)
    python -m scripts.bench.viewer_load --rows 2000 --steps 4 --out /tmp/viewer_bench

Prints one JSON line: rows, page size, build seconds, the machine's load average and CPUs (the
figures are wall times: a busy machine stretches them), `load_ms` (navigation start to the page's
first render: data parsed, charts, step table, list and the first trajectory drawn, as
`window.viewerReady`), `warm_ms` (until the background parse of every row's turns for the text
filter is done), `filter_ms` (then a text filter over every row), `open_ms` (a click on a row draws its trajectory),
and the browser's version. Needs Debian's `chromium` and `chromium-driver` and the
`selenium` package (the test install): no browser is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.viewer import build
from scripts.viewer.browser import browser_missing, chromium_driver, open_page

WORDS = ("the capital river founded tower city museum bridge painter novel battle treaty island king queen "
         "mountain century harbour railway library cathedral festival author composer empire").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _pieces(text: str) -> list[str]:
    """The text cut into word-sized pieces, as a tokenizer's would be."""
    out, start = [], 0
    for k in range(1, len(text)):
        if text[k] == " ":
            out.append(text[start:k])
            start = k
    out.append(text[start:])
    return out


def synthetic_row(rng: random.Random, step: int, prompt_id: int, uid: str, correct: bool) -> dict[str, Any]:
    """One trajectory in the dump format (verl/trainer/ppo/dump_rows.py), of Search-R1's size."""
    adv = round(rng.uniform(0.2, 1.2) * (1 if correct else -1), 4)
    turns = []
    n_search = rng.choice((0, 1, 2, 2))
    for k in range(n_search + 1):
        last = k == n_search
        query = _text(rng, 4)
        policy = f"<think> {_text(rng, 30)} </think>" + (f"<answer> {_text(rng, 2)} </answer>" if last
                                                         else f"<search> {query} </search>")
        pieces = _pieces(policy)
        doc_ids = [] if last else [[str(rng.randrange(21_000_000)) for _ in range(2)]]
        observation = "" if last else "\n\n<information>" + "".join(
            f'Doc {i + 1}(Title: "{_text(rng, 2)}") {_text(rng, 90)}\n' for i in range(2)).strip() + "</information>\n\n"
        turns.append({
            "policy": policy, "action": "answer" if last else "search", "queries": [] if last else [query],
            "observation": observation, "doc_ids": doc_ids, "calls": [], "opened": None,
            "policy_tokens": len(pieces), "obs_tokens": len(observation) // 4, "trained": len(pieces),
            "tokens": pieces, "adv": adv, "lp": [round(-rng.expovariate(2.0), 3) for _ in pieces],
        })
    length = sum(t["policy_tokens"] + t["obs_tokens"] for t in turns)
    return {
        "input": f"Answer the given question. <search> query </search> ... Question: who built the {_text(rng, 3)} "
                 f"number {prompt_id}?\n",
        "output": "".join(t["policy"] + t["observation"] for t in turns),
        "gts": {"target": [_text(rng, 2)]}, "score": float(correct), "step": step, "data_source": rng.choice(("nq", "hotpotqa")),
        "uid": uid, "index": prompt_id, "reward": float(correct), "reward_parts": {"score": float(correct), "em": int(correct)},
        "correct": correct, "advantage": adv, "trained_tokens": sum(t["trained"] for t in turns),
        "response_length": length, "n_searches": n_search,
        "stop_reason": rng.choice(("answered", "answered", "answered", "max_turns", "eos")), "turns": turns,
    }


def write_synthetic_dumps(folder: Path, rows: int, steps: int, group: int = 5, seed: int = 0) -> Path:
    """`rows` synthetic trajectories over `steps` step files under `folder/rollout` (groups of `group`
    samples of one prompt; prompts recur every few steps, so steps can be compared)."""
    rng = random.Random(seed)
    out = folder / "rollout"
    out.mkdir(parents=True, exist_ok=True)
    per_step = rows // steps
    for step in range(1, steps + 1):
        with open(out / f"{step}.jsonl", "w", encoding="utf-8") as f:
            for g in range(per_step // group):
                prompt_id = (step * 7 + g) % max(1, (per_step // group) * 2)
                uid = f"s{step}-g{g}"
                for _ in range(group):
                    correct = rng.random() < 0.2 + 0.5 * step / steps
                    f.write(json.dumps(synthetic_row(rng, step, prompt_id, uid, correct)) + "\n")
    return folder


def measure(page: Path, profile: str) -> dict[str, Any]:
    driver = chromium_driver(profile, console_log=False)
    try:
        driver.set_page_load_timeout(300)
        load_ms = open_page(driver, page, timeout_s=300)   # ms since navigation start
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(driver, 300).until(lambda d: d.execute_script("return window.viewerWarm !== undefined"))
        warm_ms = driver.execute_script("return window.viewerWarm")
        filter_ms = driver.execute_script("""
            const box = document.getElementById('f-text'), count = document.getElementById('count');
            const before = count.dataset.shown; const t0 = performance.now();
            box.value = 'cathedral festival'; box.dispatchEvent(new Event('input'));
            return new Promise((done) => { const poll = () => count.dataset.shown !== before
                ? done(performance.now() - t0 - 120) : setTimeout(poll, 2); poll(); });""")   # less the typing pause
        shown = int(driver.find_element("id", "count").get_attribute("data-shown"))
        open_ms = driver.execute_script("""
            const box = document.getElementById('f-text'); box.value = ''; box.dispatchEvent(new Event('input'));
            return new Promise((done) => setTimeout(() => {
              const rows = document.querySelectorAll('#list-body .row'); const t0 = performance.now();
              rows[rows.length - 1].click(); done(performance.now() - t0);
            }, 300));""")
        return {"load_ms": round(load_ms, 1), "warm_ms": round(warm_ms, 1), "filter_ms": round(filter_ms, 1), "filter_rows_shown": shown,
                "open_ms": round(open_ms, 1), "browser": driver.capabilities.get("browserVersion")}
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="page loads; the median is reported")
    parser.add_argument("--out", default=None, help="folder for the dumps and the page (default: a temporary one)")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        raise SystemExit(missing)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        write_synthetic_dumps(root / "dumps", args.rows, args.steps)
        start = time.perf_counter()
        page = build([root / "dumps"], root / "trajectories.html")
        build_s = time.perf_counter() - start
        runs = [measure(page, str(Path(tmp) / f"profile{k}")) for k in range(args.repeats)]
        runs.sort(key=lambda r: r["load_ms"])
        result = {"rows": args.rows, "steps": args.steps, "page_mb": round(page.stat().st_size / 1e6, 1),
                  "load_average_1min": round(os.getloadavg()[0], 1), "cpus": os.cpu_count(),
                  "build_s": round(build_s, 2), **runs[len(runs) // 2],
                  "load_ms_all": [r["load_ms"] for r in runs]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
