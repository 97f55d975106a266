"""Helpers shared by the trainer and the workers. `hf_tokenizer` is here, as in veRL, for code
written against veRL or the original Search-R1 (`from verl.utils import hf_tokenizer`)."""

from verl.utils.tokenizer import hf_tokenizer

__all__ = ["hf_tokenizer"]
