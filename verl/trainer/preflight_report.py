"""What preflight found (verl/trainer/preflight.py): the report every check writes into, its verdicts,
its one-screen rendering and its JSON. Its own module so the checks' modules (preflight.py,
preflight_memory.py) both import it and neither imports the other's importer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from verl.trainer import config_check as cc

_KEY = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)+")


def key_of(message: str) -> str:
    """The first dotted config key a message names (the key to fix), else ''."""
    match = _KEY.search(message)
    return match.group(0) if match else ""


@dataclass
class PreflightReport:
    """What preflight found: `lines` describe the run, `errors` ({key, message}) say why it would not
    start; `fits` is the memory verdict (None: not decided), `fit_message` why."""

    lines: list[str] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)   # {key, message}: shown, exit status unchanged
    world_size: int = 0
    fits: bool | None = None
    fit_message: str = ""
    gpu_reserve_gib: float | None = None          # GiB per GPU the verdict kept free (trainer.gpu_memory_reserve_gib)
    gpu_run: bool = True
    memory_plan_gib: dict[str, float] = field(default_factory=dict)
    largest_phase: str | None = None
    host_fits: bool | None = None               # the host plan against trainer.host_memory_gib (None: no verdict)
    host_message: str = ""
    host_memory_plan_gib: dict[str, float] = field(default_factory=dict)   # phase -> GiB per node
    host_largest_phase: str | None = None
    report_path: str | None = None

    def error(self, message: str, key: str | None = None) -> None:
        self.errors.append({"key": key if key is not None else key_of(message), "message": message})

    def warn(self, message: str, key: str | None = None) -> None:
        self.warnings.append({"key": key if key is not None else key_of(message), "message": message})

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def passed(self) -> bool:
        """Exit status 0: the checks pass and the plan fits (on CPU workers no GPU memory applies)."""
        return self.ok and (self.fits is True or (self.fits is None and not self.gpu_run))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "fits": self.fits, "fit_message": self.fit_message, "world_size": self.world_size,
                "gpu_reserve_gib": self.gpu_reserve_gib,
                "errors": self.errors, "warnings": self.warnings, "memory_plan_gib": self.memory_plan_gib,
                "largest_phase": self.largest_phase, "host_fits": self.host_fits, "host_message": self.host_message,
                "host_memory_plan_gib": self.host_memory_plan_gib, "host_largest_phase": self.host_largest_phase,
                "lines": self.lines}

    def render(self) -> str:
        head = "preflight (no Ray, no workers, no weights):"
        fit = {True: "fits", False: "DOES NOT FIT", None: "fit not decided"}[self.fits]
        host = {True: "fits", False: "DOES NOT FIT", None: "no verdict"}[self.host_fits]
        lines = [head, *(f"  {line}" for line in self.lines), f"  memory: {fit}: {self.fit_message}"]
        if self.host_message:
            lines.append(f"  host memory: {host}: {self.host_message}")
        if self.report_path:
            lines.append(f"  report: {self.report_path}")
        lines.extend(f"  warning: {w['message']}" for w in self.warnings)
        if self.passed:
            lines.append("preflight OK")
        else:
            problems = [f"{e['key']}: {e['message']}" if e["key"] and not e["message"].startswith(e["key"])
                        else e["message"] for e in self.errors]
            if self.fits is False or (self.fits is None and self.gpu_run):
                problems.append(f"memory: {self.fit_message}")
            lines.append(f"preflight FAILED ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise cc.ConfigError(self.render())
