"""Token ids every part of a run must agree on, read once from the model folder.

    eos = eos_token_ids(tokenizer, model_path)   # (151645, 151643) for Qwen2.5-Instruct

The end-of-sequence set is the tokenizer's EOS plus the model's `generation_config.json`
`eos_token_id` (one id or a list): Qwen2.5-Instruct's tokenizer says `<|im_end|>`, its generation
config adds `<|endoftext|>`, and a model that emits either must stop. The engine's stop ids, the
HF sampling loop and the generation manager's turn cut all take this one set (meta_info
`eos_token_id`).

`hf_tokenizer(path)` loads a tokenizer the way veRL does (a missing pad token becomes EOS), for
code written against veRL or the original Search-R1.
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


def hf_tokenizer(name_or_path: Any, correct_pad_token: bool = True, correct_gemma2: bool = True, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(name_or_path, **kwargs)` as veRL loads it: a tokenizer without a
    pad token pads with its EOS (with a warning), and gemma-2-2b-it ends turns at `<end_of_turn>`
    (id 107), which its tokenizer does not name as EOS."""
    import warnings

    from transformers import AutoTokenizer

    if correct_gemma2 and isinstance(name_or_path, str) and "gemma-2-2b-it" in name_or_path:
        warnings.warn("gemma-2-2b-it tokenizer: eos_token set to <end_of_turn> (id 107)", stacklevel=2)
        kwargs["eos_token"] = "<end_of_turn>"
        kwargs["eos_token_id"] = 107
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if correct_pad_token:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
            warnings.warn(f"tokenizer.pad_token_id is None; set to the EOS id {tokenizer.eos_token_id}", stacklevel=2)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
            warnings.warn(f"tokenizer.pad_token is None; set to the EOS token {tokenizer.eos_token!r}", stacklevel=2)
    return tokenizer
