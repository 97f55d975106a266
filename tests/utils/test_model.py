"""Model loading (verl/utils/model.py): packing never silently falls back to sdpa.

On this CPU machine flash-attn is not installed, so Hugging Face refuses
attn_implementation="flash_attention_2" with an ImportError: the same refusal a GPU machine
gets from a flash-attn built for another torch or CUDA.
"""

from __future__ import annotations

import logging

import pytest

from verl.utils.model import build_causal_lm, build_value_model, load_causal_lm, load_value_model

FLASH = "flash_attention_2"


@pytest.mark.parametrize(("load", "key"), [
    (load_causal_lm, "actor_rollout_ref.model.use_remove_padding"),
    (build_causal_lm, "actor_rollout_ref.model.use_remove_padding"),
    (load_value_model, "critic.model.use_remove_padding"),
    (build_value_model, "critic.model.use_remove_padding"),
])
def test_packing_with_a_refused_flash_attention_is_an_error_naming_the_key(tiny_model_dir, load, key):
    with pytest.raises(ValueError, match=rf"{key}=True needs attn_implementation='{FLASH}'") as err:
        load(tiny_model_dir, attn_implementation=FLASH, use_remove_padding=True)
    assert "pip install flash-attn" in str(err.value) and f"set {key}=False" in str(err.value)


@pytest.mark.parametrize("load", [load_causal_lm, build_value_model])
def test_without_packing_the_default_kernel_is_used_and_logged(tiny_model_dir, load, caplog):
    with caplog.at_level(logging.WARNING, logger="verl.utils.model"):
        model = load(tiny_model_dir, attn_implementation=FLASH, use_remove_padding=False)
    # A fresh config for the retry: the refused kernel must not stick to it.
    assert model.config._attn_implementation != FLASH
    assert any(f"attn_implementation={FLASH} unavailable" in r.getMessage() for r in caplog.records)


def _refused(attn: dict) -> None:
    raise ImportError("refused by the test")


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding"])
def test_a_refused_packing_kernel_says_what_that_kernel_needs(key):
    """Only model.packing_kernel=flash_attn needs the flash-attn package: the message for the
    registered packed attention (torch's varlen_attn) must not send the user to install it."""
    from verl.utils.attention import PACKED_ATTENTION, PACKED_FLASH_ATTENTION
    from verl.utils.model import _instantiate

    kernel_key = key.replace("use_remove_padding", "packing_kernel")
    with pytest.raises(ValueError, match=rf"{key}=True needs attn_implementation='{PACKED_ATTENTION}'") as err:
        _instantiate(_refused, PACKED_ATTENTION, True, key)
    message = str(err.value)
    assert "refused by the test" in message and "no extra package" in message and f"set {key}=False" in message
    assert "flash-attn" not in message and "flash_attn" not in message
    with pytest.raises(ValueError, match=rf"{key}=True needs attn_implementation='{PACKED_FLASH_ATTENTION}'") as err:
        _instantiate(_refused, PACKED_FLASH_ATTENTION, True, key)
    message = str(err.value)
    assert f"{kernel_key}=flash_attn needs flash-attn: install it with `pip install flash-attn" in message
    assert f"set {kernel_key}=varlen_attn" in message and f"set {key}=False" in message
