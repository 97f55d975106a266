"""The trajectory viewer: dump files in, ONE self-contained HTML page out (no server, no network).

    python -m scripts.viewer outputs/demo/dumps -o trajectories.html
    python -m scripts.viewer run/rollout run/validation answers.jsonl -o run.html

Each argument is a dump folder (`<step>.jsonl` files: `trainer.rollout_data_dir`,
`trainer.validation_data_dir`), a folder holding such folders (each becomes one set: the demo's
`dumps/` with `rollout/` and `validation/`), or one JSONL file (`infer.py --dump`). Rows are the
trainer's dumps (verl/trainer/ppo/dump_rows.py; docs/viewer.md); veRL's own dumps (input, output,
score, step) are read too, as one turn each.

The page holds the data as JSON and its script and style inline; it opens from disk in any
browser. It reads only the dump files: no import of the trainer, so it works on any run's folder.
Everything in a dump (what a policy wrote, what a page held) is shown as text, never as markup.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
STEP_FILE_RE = re.compile(r"^(\d+)\.jsonl$")
# A row is kept as the dump has it, less what the page does not show (the decoded response is the
# turns back to back) and the prompt, which is stored once for every row that shares it.
DROPPED_KEYS = ("output", "input")


class DumpError(ValueError):
    """A dump file or row the viewer cannot read; the message names the file, line and key."""


@dataclass
class ViewerData:
    """What the page embeds: rows (each with `set` and `prompt`, an index into `prompts`)."""

    sets: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)   # the files read, for the page's header
    _prompt_ids: dict[str, int] = field(default_factory=dict, repr=False)

    def prompt_id(self, text: str) -> int:
        if text not in self._prompt_ids:
            self._prompt_ids[text] = len(self.prompts)
            self.prompts.append(text)
        return self._prompt_ids[text]

    def to_json(self) -> dict[str, Any]:
        return {"sets": self.sets, "prompts": self.prompts, "rows": self.rows, "files": self.sources}


def _turns_of(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The row's turns; a veRL dump (no turns) is one turn: its output, all policy text."""
    turns = row.get("turns")
    if turns is None:
        output = row.get("output")
        if not isinstance(output, str):
            raise DumpError(f"{where}: a row needs 'turns' (this project's dumps) or 'output' (veRL's), a string")
        return [{"policy": output, "observation": ""}]
    if not isinstance(turns, list):
        raise DumpError(f"{where}: 'turns' must be a list, got {type(turns).__name__}")
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("policy", ""), str) \
                or not isinstance(turn.get("observation", ""), str):
            raise DumpError(f"{where}: turns[{k}] must be an object whose 'policy' and 'observation' are strings")
    return turns


def read_row(line: str, where: str) -> dict[str, Any]:
    """One dump line, checked for what the page reads."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DumpError(f"{where}: not a JSON object ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise DumpError(f"{where}: not a JSON object (a {type(row).__name__})")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise DumpError(f"{where}: 'step' must be an integer, got {step!r}")
    if not isinstance(row.get("input", ""), str):
        raise DumpError(f"{where}: 'input' must be a string")
    for key in ("score", "reward", "advantage"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DumpError(f"{where}: {key!r} must be a number or null, got {value!r}")
    row["turns"] = _turns_of(row, where)
    return row


def read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield read_row(line, f"{path}:{number}")


def dump_sets(paths: Sequence[str | Path]) -> list[tuple[str, list[Path]]]:
    """(set name, its files) for each argument: a folder of step files, a folder of such folders,
    or a JSONL file."""
    out: list[tuple[str, list[Path]]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            out.append((path.stem, [path]))
            continue
        if not path.is_dir():
            raise DumpError(f"{path}: no such file or folder")
        files = step_files(path)
        if files:
            out.append((path.name, files))
            continue
        nested = [(sub.name, step_files(sub)) for sub in sorted(path.iterdir()) if sub.is_dir()]
        nested = [(name, files) for name, files in nested if files]
        if not nested:
            raise DumpError(f"{path}: no <step>.jsonl files in it or in the folders under it")
        out += nested
    return out


def step_files(folder: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def collect(paths: Sequence[str | Path]) -> ViewerData:
    data = ViewerData()
    names: dict[str, int] = {}
    for name, files in dump_sets(paths):
        if name in names:   # two folders of one name (run1/rollout, run2/rollout): number them
            names[name] += 1
            name = f"{name} ({names[name]})"
        else:
            names[name] = 1
        set_id = len(data.sets)
        data.sets.append(name)
        for path in files:
            data.sources.append(str(path))
            for row in read_jsonl(path):
                prompt = row.get("input") or ""
                for key in DROPPED_KEYS:
                    row.pop(key, None)
                row["set"] = set_id
                row["prompt"] = data.prompt_id(prompt)
                data.rows.append(row)
    return data


def embedded_json(value: Any) -> str:
    """JSON safe inside a <script> element: `<`, `>` and `&` escaped, so no text in a dump can close
    the element or open a comment; U+2028/9 escaped for old parsers."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, code in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                       ("\u2029", "\\u2029")):
        text = text.replace(char, code)
    return text


def _adv_max(turns: list[dict[str, Any]]) -> float:
    """The largest |advantage| of a row's policy tokens (0 when it has none)."""
    best = 0.0
    for turn in turns:
        adv = turn.get("adv")
        values = adv if isinstance(adv, list) else [adv]
        for value in values:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                best = max(best, abs(float(value)))
    return best


def _compact_turn(turn: dict[str, Any], observations: dict[str, int]) -> dict[str, Any]:
    """A turn as the page stores it: the policy text left out when its token pieces join to it, the
    observation as the number of its line (one line per distinct observation: a group's rows and
    every validation's often read the same passages)."""
    out = dict(turn)
    tokens = out.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) and "".join(tokens) == out.get("policy"):
        del out["policy"]
    text = out.pop("observation", "") or ""
    if text:
        out["obs"] = observations.setdefault(text, len(observations))
    return out


def payload(data: ViewerData) -> str:
    """The page's data as JSON lines: the first holds everything but the turns (the list, the filters
    and the charts read it at once); line i + 1 holds row i's turns, then one line per distinct
    observation; these are parsed when a row is shown or searched."""
    head = data.to_json()
    rows, lines = [], []
    observations: dict[str, int] = {}
    for row in data.rows:
        summary = {k: v for k, v in row.items() if k != "turns"}
        summary["adv_max"] = _adv_max(row["turns"])   # the colour scale, without parsing every turn
        rows.append(summary)
        lines.append(embedded_json([_compact_turn(t, observations) for t in row["turns"]]))
    head["rows"] = rows
    head["n_observations"] = len(observations)
    return "\n".join([embedded_json(head), *lines, *map(embedded_json, observations)])


def render_page(data: ViewerData, title: str = "Search-R1 trajectories", compress: bool = True) -> str:
    """The page: template, style, script and data in one HTML string. `compress`: the data gzipped
    and base64-encoded (the browser inflates it with DecompressionStream), a page about a fifth the
    size, read and parsed that much faster; else the JSON lines as they are."""
    template = (HERE / "page.html").read_text(encoding="utf-8").replace("{{TITLE}}", escape(title))
    text = payload(data)
    if compress:
        encoding, text = "gzip+base64", base64.b64encode(gzip.compress(text.encode("utf-8"), 6, mtime=0)).decode("ascii")
    else:
        encoding = "plain"
    parts = {
        "{{STYLE}}": (HERE / "viewer.css").read_text(encoding="utf-8"),
        "{{SCRIPT}}": (HERE / "viewer.js").read_text(encoding="utf-8"),
        "{{ENCODING}}": encoding,
        "{{DATA}}": text,
    }
    for key, value in parts.items():
        # one pass each, and the data last: nothing in it is read as a placeholder
        head, sep, tail = template.partition(key)
        if not sep:
            raise RuntimeError(f"scripts/viewer/page.html lacks the placeholder {key}")
        template = head + value + tail
    return template


def build(paths: Sequence[str | Path], output: str | Path, title: str = "Search-R1 trajectories",
          compress: bool = True) -> Path:
    """Read the dumps at `paths`, write the page to `output`; returns its path."""
    data = collect(paths)
    if not data.rows:
        raise DumpError(f"{', '.join(map(str, paths))}: the dump files hold no rows")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render_page(data, title, compress), encoding="utf-8")
    tmp.replace(out)
    return out
