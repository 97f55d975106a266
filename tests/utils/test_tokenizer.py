"""One EOS set for a run: the tokenizer's EOS plus the model's generation_config EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from verl.utils.tokenizer import eos_token_ids


def test_generation_config_eos_ids_join_the_tokenizers(tiny_model_dir: str, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    # As Qwen2.5-Instruct: tokenizer <|im_end|>, generation config [<|im_end|>, <|endoftext|>].
    other = tok.pad_token_id
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, other]}))
    assert eos_token_ids(tok, str(model)) == (tok.eos_token_id, other)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": other}))
    assert eos_token_ids(tok, str(model)) == (tok.eos_token_id, other)
    (model / "generation_config.json").unlink()
    assert eos_token_ids(tok, str(model)) == (tok.eos_token_id,)


def test_no_eos_anywhere_is_an_error(tmp_path: Path) -> None:
    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="no EOS token"):
        eos_token_ids(NoEos(), str(tmp_path))


def test_the_trainer_sends_the_whole_set_to_the_engines(tiny_model_dir: str) -> None:
    from omegaconf import OmegaConf

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import batch_keys as K

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)   # _gen_meta reads config, tokenizer and the EOS set only
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"do_sample": True, "temperature": 1.0,
                                                                         "stop": ["</search>"]}},
                                       "data": {"max_response_length": 8}, "do_search": True})
    trainer.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer._eos_token_ids = (trainer.tokenizer.eos_token_id, 5)
    assert trainer._gen_meta(validation=False)[K.META_EOS_TOKEN_ID] == [trainer.tokenizer.eos_token_id, 5]
