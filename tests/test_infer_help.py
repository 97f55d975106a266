"""`python infer.py --help` names the model folder the offline demo really writes.

The demo (scripts/demo/run_demo.py) exports its last checkpoint's HF model to
`<trainer.default_local_dir>/global_step_<last step>/hf` and records it as summary.json's
`hf_model_dir`; the last step is the last validation's, which with the demo's positive
test_freq is trainer.total_training_steps. The expected path is computed from the demo's own
overrides, so changing the demo's output folder or step count makes this test point at the help.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo_hf_model_dir() -> Path:
    from scripts.demo.build import DemoSettings
    from scripts.demo.run_demo import rl_overrides
    from verl.trainer.main_ppo import compose_config

    placeholders = {key: Path(key) for key in ("train", "test", "model")}
    config = compose_config(rl_overrides(DemoSettings(), placeholders, [], "http://placeholder/retrieve"))
    assert int(config.trainer.test_freq) > 0   # so the last validation is at the last step
    return Path(config.trainer.default_local_dir) / f"global_step_{int(config.trainer.total_training_steps)}" / "hf"


def test_help_names_the_hf_model_folder_the_demo_writes() -> None:
    result = subprocess.run([sys.executable, "infer.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    named = re.findall(r"--model_path\s+(outputs/\S+)", result.stdout)
    assert named, f"infer.py --help shows no demo model path:\n{result.stdout}"
    expected = _demo_hf_model_dir()
    assert [Path(p) for p in named] == [expected] * len(named), (named, expected)
