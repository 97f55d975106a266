"""Text <-> token ids for the rollout: observations are encoded once, sampled ids are decoded only
to find an action, and a turn that ran past its action is cut by token position.

Shared by the generation manager (`generation.py`, the tag protocol's rules) and the tool protocol's
rules (`tool_turns.py`), so neither reaches into the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TokenText:
    """One tokenizer's encode/decode as the rollout uses them: no special tokens added, none skipped,
    no clean-up of spaces (what is decoded is what the ids say)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def shortest_prefix(self, sampled: list[int], complete: Callable[[str], bool]) -> list[int]:
        """The shortest prefix of `sampled` whose decoded text satisfies `complete` (true for the
        whole); the predicate is monotone in the prefix length, so O(log n) decodes."""
        lo, hi = 1, len(sampled)
        while lo < hi:
            mid = (lo + hi) // 2
            if complete(self.decode(sampled[:mid])):
                hi = mid
            else:
                lo = mid + 1
        return sampled[:lo]


__all__ = ["TokenText"]
