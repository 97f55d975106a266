"""The GPU install sequence the docs give is the one the code and setup.py agree on (issue 21 item 15).

flash-attn builds against the torch already installed (`--no-build-isolation`), so it is not an
extra: the `gpu` extra installs the pinned vLLM only, and the docs, the README and every error
message give the same flash-attn command after it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from verl.utils.attention import FLASH_ATTN_INSTALL
from verl.workers.rollout.vllm_rollout import VLLM_VERSION

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXTRAS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no EXTRAS")


def test_the_gpu_extra_is_the_pinned_vllm_and_no_source_build() -> None:
    gpu = _extras()["gpu"]
    assert gpu == [f"vllm=={VLLM_VERSION}"]
    assert not any(req.startswith("flash") for req in gpu)


def test_docs_and_readme_give_the_same_install_sequence() -> None:
    training = (ROOT / "docs" / "training.md").read_text()
    section = training.split("## Installing on GPUs", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for line in section.splitlines() if line.startswith("pip install")]
    # CUDA torch first, the gpu extra next, then flash-attn against that torch.
    assert commands[0].startswith("pip install torch==2.13.0")
    assert '.[retriever,gpu]' in commands[1]
    assert commands[2] == FLASH_ATTN_INSTALL
    readme = (ROOT / "README.md").read_text()
    assert FLASH_ATTN_INSTALL in readme and '".[retriever,gpu]"' in readme
    assert not re.search(r"gpu\]?\"?\s*#.*adds.*flash-attn", readme)
