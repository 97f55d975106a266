"""The trajectory viewer (scripts/viewer): one self-contained page from dump files, tested in the
system's Chromium (Debian's chromium + chromium-driver under Selenium; nothing is downloaded).

The dumps are the trainer's own (TrajectoryDumps over a rolled-out, scored batch: the generation
manager against a real BM25 server), two training steps and two validations; one trajectory's
policy text and one retrieved page hold markup, which must stay text."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.viewer import DumpError, build, collect
from scripts.viewer.browser import browser_missing, chromium_driver, open_page
from tests.trainer._dump_batch import HOSTILE, bm25_url, make_tokenizer, rolled_out_batch
from verl.trainer.ppo.dumps import DumpConfig, TrajectoryDumps
from verl.utils import batch_keys as K


@pytest.fixture(scope="module")
def dump_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<root>/rollout/{1,2}.jsonl and <root>/validation/{0,2}.jsonl, written by the trainer's dumper."""
    root = tmp_path_factory.mktemp("dumps")
    tokenizer = make_tokenizer()
    dumps = TrajectoryDumps(DumpConfig(root / "rollout", root / "validation", max_rows=None), tokenizer)
    dumps.start(0)
    with bm25_url(tmp_path_factory.mktemp("bm25")) as url:
        for step in (1, 2):
            dumps.write_rollout(rolled_out_batch(tokenizer, url, seed=step), step)
        for step in (0, 2):
            batch = rolled_out_batch(tokenizer, url, keys=("q1", "q2", "q4"), samples=1, seed=step)
            scores = batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1)
            dumps.add_validation(batch, scores)
            dumps.end_validation(step)
    return root


def dumped_rows(root: Path) -> list[dict]:
    """The rows in the page's order: sets (folders) by name, files by step, lines in order."""
    rows = []
    for folder in ("rollout", "validation"):
        for path in sorted((root / folder).glob("*.jsonl"), key=lambda p: int(p.stem)):
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows


@pytest.fixture(scope="module")
def page(dump_root: Path) -> Path:
    return build([dump_root], dump_root / "trajectories.html")


# --- the file -------------------------------------------------------------------------------


def test_the_page_is_one_file_that_fetches_nothing(page: Path, dump_root: Path) -> None:
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"<(link|img|iframe|object|embed)\b", html, re.I)
    assert not re.search(r"<script[^>]*\bsrc=", html, re.I)
    assert not re.search(r"\b(fetch|XMLHttpRequest|WebSocket|EventSource|import)\s*\(", html)
    assert "url(" not in html and "@import" not in html
    assert "default-src 'none'" in html      # the CSP forbids any load the page might still attempt
    # only the page's own two scripts close: no text of the dump (it holds `</script>`) ends one
    assert html.count("</script>") == 2
    assert any(HOSTILE in t["policy"] for r in dumped_rows(dump_root) for t in r["turns"])
    # --no-compress embeds the JSON lines as they are, with markup characters escaped
    plain = build([dump_root], dump_root / "plain.html", compress=False).read_text(encoding="utf-8")
    assert plain.count("</script>") == 2 and "\\u003c/script\\u003e" in plain


def test_sets_steps_and_prompts_are_read_from_the_folders(dump_root: Path) -> None:
    data = collect([dump_root])
    assert data.sets == ["rollout", "validation"]
    assert [(r["set"], r["step"]) for r in data.rows] == [(0, 1)] * 8 + [(0, 2)] * 8 + [(1, 0)] * 3 + [(1, 2)] * 3
    assert len(data.prompts) == 4     # the four questions, stored once for their 22 rows
    # a step folder named directly is one set; a JSONL file too (infer.py --dump)
    assert collect([dump_root / "validation"]).sets == ["validation"]
    assert collect([dump_root / "rollout" / "2.jsonl"]).sets == ["2"]


def test_a_veRL_dump_is_read_as_one_turn(tmp_path: Path) -> None:
    folder = tmp_path / "verl"
    folder.mkdir()
    (folder / "3.jsonl").write_text(json.dumps({"input": "Q?", "output": "A", "gts": "A", "score": 1.0, "step": 3}) + "\n")
    row, = collect([folder]).rows
    assert row["turns"] == [{"policy": "A", "observation": ""}] and row["step"] == 3


@pytest.mark.parametrize("line, names", [
    ("not json", "not a JSON object"),
    ('["a"]', "not a JSON object"),
    ('{"input": "q", "output": "a"}', "'step' must be an integer"),
    ('{"step": 1, "input": "q"}', "'turns'"),
    ('{"step": 1, "turns": [{"policy": 3}]}', "turns[0]"),
    ('{"step": 1, "output": "a", "score": "high"}', "'score' must be a number"),
])
def test_a_bad_dump_line_is_refused_naming_the_file_and_line(tmp_path: Path, line: str, names: str) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "1.jsonl").write_text(json.dumps({"step": 1, "output": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(DumpError, match=re.escape(f"{folder / '1.jsonl'}:3: ") + ".*" + re.escape(names)):
        build([folder], tmp_path / "out.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="empty: no <step>.jsonl files"):
        build([tmp_path / "empty"], tmp_path / "out.html")
    with pytest.raises(DumpError, match="missing: no such file or folder"):
        build([tmp_path / "missing"], tmp_path / "out.html")


# --- in the browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    missing = browser_missing()
    if missing:
        pytest.skip(f"no browser for the viewer tests: {missing}")
    profile = tmp_path_factory.mktemp("chromium-profile")
    drv = chromium_driver(str(profile))
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def opened(driver, page: Path):
    """The page freshly loaded; its console checked after the test."""
    open_page(driver, page)
    driver.get_log("browser")   # start from an empty log (the load is checked in its own test)
    yield driver
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"console errors: {errors}"


def _shown(driver) -> int:
    return int(driver.find_element("id", "count").get_attribute("data-shown"))


def _set(driver, element_id: str, value: str) -> None:
    """Set a filter as a user would (the element's value, then its change/input event)."""
    driver.execute_script("""const el = document.getElementById(arguments[0]); el.value = arguments[1];
        el.dispatchEvent(new Event(el.tagName === 'SELECT' ? 'change' : 'input'));""", element_id, value)
    if element_id in ("f-text", "f-min-reward", "f-max-reward"):
        driver.execute_script("return new Promise((done) => setTimeout(done, 250))")   # the typing debounce


def test_the_page_loads_with_no_console_errors_and_draws_every_row(driver, page: Path, dump_root: Path) -> None:
    load_ms = open_page(driver, page)
    assert load_ms > 0
    assert [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    assert int(driver.find_element("id", "count").get_attribute("data-total")) == len(dumped_rows(dump_root))
    assert _shown(driver) == 22
    assert len(driver.find_elements("css selector", "#steps tr.step")) == 4          # (set, step) pairs
    assert len(driver.find_elements("css selector", "#charts svg polyline")) == 4 * 2   # 4 charts x 2 sets
    assert driver.find_elements("css selector", "#detail .traj")   # the first trajectory is open


def test_filters_change_the_visible_rows(opened, dump_root: Path) -> None:
    rows = dumped_rows(dump_root)
    d = opened
    _set(d, "f-correct", "0")
    assert _shown(d) == sum(not r["correct"] for r in rows) < len(rows)
    _set(d, "f-correct", "")
    _set(d, "f-set", "1")
    assert _shown(d) == 6
    _set(d, "f-step", "2")
    assert _shown(d) == 3
    _set(d, "f-set", "")
    assert _shown(d) == 8 + 3     # step 2 of both sets
    _set(d, "f-step", "")
    _set(d, "f-source", "hotpotqa")
    assert _shown(d) == sum(r["data_source"] == "hotpotqa" for r in rows) == 6
    _set(d, "f-source", "")
    _set(d, "f-searches", "2")
    assert _shown(d) == sum(r["n_searches"] == 2 for r in rows)
    _set(d, "f-searches", "")
    _set(d, "f-stop", "eos")
    assert _shown(d) == sum(r["stop_reason"] == "eos" for r in rows) == 4
    _set(d, "f-stop", "")
    _set(d, "f-min-reward", "0.5")
    assert _shown(d) == sum(r["reward"] >= 0.5 for r in rows)
    _set(d, "f-min-reward", "")
    _set(d, "f-text", "eiffel tower")      # the second query's text and its passage
    assert _shown(d) == sum("Eiffel Tower" in json.dumps(r["turns"]) for r in rows) > 0
    _set(d, "f-text", "")
    assert _shown(d) == len(rows)
    # the list draws only the rows in view, and draws the filtered ones
    _set(d, "f-correct", "1")
    drawn = d.find_elements("css selector", "#list-body .row")
    assert 0 < len(drawn) <= _shown(d)


def test_a_trajectorys_masked_spans_are_exactly_the_dumps_observations(opened, dump_root: Path) -> None:
    rows = dumped_rows(dump_root)
    d = opened
    for i, row in enumerate(rows):
        d.execute_script("document.querySelector(`#list-body .row[data-i='${arguments[0]}']`)?.click()", i)
        if not d.find_elements("css selector", f"#detail .traj[data-i='{i}']"):   # not in view: scroll to it
            d.execute_script("const b = document.getElementById('list-body'); b.scrollTop = arguments[0] * 26;"
                             "b.dispatchEvent(new Event('scroll'));", i)
            d.execute_script("return new Promise((done) => requestAnimationFrame(() => setTimeout(done, 50)))")
            d.execute_script("document.querySelector(`#list-body .row[data-i='${arguments[0]}']`).click()", i)
        box = d.find_element("css selector", f"#detail .traj[data-i='{i}']")
        masked = d.execute_script("return [...arguments[0].querySelectorAll('.obs')].map((e) => e.textContent)", box)
        assert masked == [t["observation"] for t in row["turns"] if t["observation"]], f"row {i}"
        policy = d.execute_script("return [...arguments[0].querySelectorAll('.policy')].map((e) => e.textContent)", box)
        assert policy == [t["policy"] for t in row["turns"]], f"row {i}"
        # a masked span is drawn as not trained; a policy token carries its advantage
        if masked:
            assert "not trained" in box.find_element("css selector", ".obs-label").text
    assert opened.execute_script("return window.__pwned") is None


def test_markup_in_a_dump_is_shown_as_text(opened, dump_root: Path) -> None:
    rows = dumped_rows(dump_root)
    hostile = next(i for i, r in enumerate(rows) if HOSTILE in r["turns"][-1]["policy"])
    _set(opened, "f-text", "onerror")
    opened.execute_script("document.querySelector(`#list-body .row[data-i='${arguments[0]}']`).click()", hostile)
    for colour in ("adv", "none"):   # token by token, and the whole policy text as one span
        _set(opened, "f-colour", colour)
        detail = opened.find_element("id", "detail")
        assert not detail.find_elements("css selector", "img, script")
        assert "bold" not in [b.text for b in detail.find_elements("css selector", "b")]   # the page's own <b> only
        assert HOSTILE in detail.text.replace("\n", "")
        assert opened.execute_script("return window.__pwned") is None


def test_the_same_prompt_side_by_side_across_two_steps(opened, dump_root: Path) -> None:
    d = opened
    d.execute_script("document.querySelector(`#list-body .row[data-i='0']`).click()")   # q1, rollout step 1
    options = d.execute_script("return [...document.getElementById('compare').options].map((o) => o.text)")
    assert options == ["—", "rollout step 2", "validation step 0", "validation step 2"]
    _set(d, "compare", "0:2")
    columns = d.find_elements("css selector", "#detail .columns.two .col")
    assert len(columns) == 2
    right = columns[1].find_elements("css selector", ".traj")
    rows = dumped_rows(dump_root)
    assert [rows[int(t.get_attribute("data-i"))]["step"] for t in right] == [2, 2]
    assert {rows[int(t.get_attribute("data-i"))]["index"] for t in right} == {rows[0]["index"]}


def test_a_screenshot_is_written(opened, tmp_path: Path) -> None:
    out = tmp_path / "viewer.png"
    opened.execute_script("document.querySelector(`#list-body .row[data-i='0']`).click()")
    assert opened.save_screenshot(str(out))
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1500, 1000) or width > 1000
    assert out.stat().st_size > 20_000   # a drawn page, not a blank one
