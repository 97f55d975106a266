"""Token ids every part of a run must agree on, read once from the model folder.

    eos = eos_token_ids(tokenizer, model_path)   # (151645, 151643) for Qwen2.5-Instruct

The end-of-sequence set is the tokenizer's EOS plus the model's `generation_config.json`
`eos_token_id` (one id or a list): Qwen2.5-Instruct's tokenizer says `<|im_end|>`, its generation
config adds `<|endoftext|>`, and a model that emits either must stop. The engine's stop ids, the
HF sampling loop and the generation manager's turn cut all take this one set (meta_info
`eos_token_id`).
"""

from __future__ import annotations

from typing import Any


def eos_token_ids(tokenizer: Any, model_path: str | None = None, generation_config: Any = None) -> tuple[int, ...]:
    """The tokenizer's EOS id first, then the generation config's others, without repeats. The
    generation config is `generation_config` when given (a loaded model's), else read from `model_path`."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    extras = _eos_list(generation_config.eos_token_id) if generation_config is not None else _generation_config_eos(model_path)
    for extra in extras:
        if extra not in ids:
            ids.append(extra)
    if not ids:
        raise ValueError(f"no EOS token: the tokenizer has no eos_token_id and {model_path!r} has no "
                         "generation_config.json eos_token_id")
    return tuple(ids)


def _generation_config_eos(model_path: str | None) -> list[int]:
    if not model_path:
        return []
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:   # no generation_config.json: the tokenizer's EOS alone
        return []
    return _eos_list(config.eos_token_id)


def _eos_list(eos: Any) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]
