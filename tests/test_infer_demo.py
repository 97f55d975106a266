"""`python infer.py --demo`: the demo's summary names the trained model and data; infer.py starts
the demo's BM25 server itself (free 127.0.0.1 port, stopped at exit) and asks a held-out question.

The "trained" model here is the shipped warm start (example/demo_warmstart/), an HF folder of the
same shape as the demo's export; the world and its index are built small in a temp folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from scripts.demo.build import DemoSettings, build_corpus_and_index, build_questions
from scripts.demo.run_demo import DemoSummary, held_out_questions, print_summary, try_command

ROOT = Path(__file__).resolve().parents[1]
WARMSTART = ROOT / "example" / "demo_warmstart"


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished demo's output folder, as run_demo leaves it: summary.json naming model and data."""
    tmp = tmp_path_factory.mktemp("demo")
    settings = DemoSettings(data_dir=str(tmp / "data"), output_dir=str(tmp / "out"), n_val_per_kind=2, n_train=64)
    build_corpus_and_index(settings)
    _, test_pq = build_questions(settings)
    out = Path(settings.output_dir)
    out.mkdir()
    summary = DemoSummary(
        algorithm="grpo", val_em_before=0.3, val_em_after=0.8, val_em_before_by_source={},
        val_em_after_by_source={}, rl_steps=12, wall_seconds=1.0, rl_seconds=1.0, checkpoint_dir=str(tmp / "ckpt"),
        hf_model_dir=str(WARMSTART), metrics_path=str(tmp / "m.jsonl"), plot_path=str(tmp / "p.png"),
        data_dir=str(settings.root), try_command=try_command(test_pq, out))
    (out / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
    return out


def run_infer(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "infer.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_command_the_demo_summary_prints_runs_as_printed(demo_out: Path, capsys: pytest.CaptureFixture) -> None:
    summary = DemoSummary(**json.loads((demo_out / "summary.json").read_text()))
    print_summary(summary, demo_out / "summary.json")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("try it:")]
    cmd = shlex.split(printed[0].removeprefix("try it:"))
    assert cmd[:3] == ["python", "infer.py", "--demo"]
    # The question filled in is a real held-out two-hop question of the demo's validation data.
    question, golden = held_out_questions(Path(summary.data_dir) / "test.parquet")[0]
    assert cmd[cmd.index("--question") + 1] == question

    proc = run_infer(cmd[2:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"# Question: {question}" in proc.stdout
    assert re.search(r"# Answer: .+ \((answered|max_turns|eos|invalid_action), \d searches\)", proc.stdout)
    assert f"# Golden answer: {golden[0]}" in proc.stdout
    # The server infer.py started for the demo is gone once it exits.
    url = re.search(r"retrieval server \(pid \d+\) at (\S+)", proc.stdout).group(1)
    with pytest.raises(requests.ConnectionError):
        requests.get(url.replace("/retrieve", "/health"), timeout=2)


def test_the_demo_model_searches_the_demo_server_then_answers(demo_out: Path) -> None:
    data = Path(json.loads((demo_out / "summary.json").read_text())["data_dir"])
    # A birthplace question: the warm start searches for these (docs/demo.md), so the episode
    # shows the whole loop: query, the demo corpus's passage from the server, answer.
    question, golden = held_out_questions(data / "test.parquet", "demo_onehop")[0]
    assert question.startswith("Where was ")
    person = question.removeprefix("Where was ").removesuffix(" born?")
    proc = run_infer(["--demo", "--demo_output_dir", str(demo_out), "--question", question])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"<search> .+ </search>", proc.stdout)
    assert f'<information>Doc 1(Title: "{person}") {person} was born in {golden[0]}' in proc.stdout
    assert re.search(r"<answer> .+ </answer>", proc.stdout)
    assert "answered, 1 searches" in proc.stdout


def test_without_a_demo_run_it_says_to_run_the_demo_first(tmp_path: Path) -> None:
    from infer import main

    with pytest.raises(SystemExit, match=r"no trained demo model: .*summary.json does not exist.*bash train_grpo.sh"):
        main(["--demo", "--demo_output_dir", str(tmp_path / "nowhere")])


def test_a_tool_protocol_demo_run_is_refused_with_what_to_do(tmp_path: Path) -> None:
    from infer import main

    (tmp_path / "summary.json").write_text(json.dumps({"hf_model_dir": str(WARMSTART), "protocol": "tool"}))
    with pytest.raises(SystemExit, match=r"demo.protocol=tool run; .*point --demo_output_dir at a tags run"):
        main(["--demo", "--demo_output_dir", str(tmp_path)])
