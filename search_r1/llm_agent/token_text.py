"""Text <-> token ids for the rollout: observations are encoded once, sampled ids are decoded only
to find an action, and a turn that ran past its action is cut by token position.

Shared by the generation manager (`generation.py`, the tag protocol's rules) and the tool protocol's
rules (`tool_turns.py`), so neither reaches into the other for it.

Text from outside the policy's control of the format (a page, a search hit, a tool's answer) is
tokenized with special tokens split (`encode_plain`): a page holding `<|im_end|>\\n<|im_start|>user`
becomes ordinary text tokens, not the chat template's control ids, so it cannot forge a turn. Only the
chat framing the template writes around tool messages keeps its special tokens (`encode_framed`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any


class TokenText:
    """One tokenizer's encode/decode as the rollout uses them: no special tokens added, none skipped,
    no clean-up of spaces (what is decoded is what the ids say)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # Text of each special token -> id: the added tokens marked special (<|im_end|>, <|im_start|>, ...),
        # the ones split_special_tokens stops recognizing (non-special added tokens, e.g. tags, stay whole).
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special_ids = {tok.content: int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
        # Longest first, so the alternation finds the longest special token at a position, as the tokenizer does.
        ordered = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def encode(self, text: str) -> list[int]:
        """Framing text: a special token's text is that special token."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Outside text (an observation's contents): a special token's text is ordinary text tokens.
        Equal to `encode` for any text that holds no special token's text, and encoded by it then."""
        if not self.has_special(text):
            return self.encode(text)
        # A fast tokenizer sets this flag on its backend at each call (every encode sets it back), so the
        # rollout's encodes must not run on two threads at once: they run on the loop's thread only.
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def has_special(self, text: str) -> bool:
        """True when `text` holds the text of a special token."""
        return self._special_re is not None and self._special_re.search(text) is not None

    def encode_framed(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """`pieces` (text, is_content) joined and tokenized as one text, with special tokens only where the
        framing (is_content False) writes them. As the tokenizer does for a whole text: split at the special
        tokens, each span between them encoded on its own; a span runs across the framing/content borders,
        so merges there are the whole text's. Equal to `encode("".join(texts))` when no content holds a
        special token's text (tests check it on the test tokenizers and SmolLM2's)."""
        ids: list[int] = []
        pending: list[str] = []
        for text, is_content in pieces:
            if is_content or self._special_re is None:
                pending.append(text)
                continue
            pos = 0
            for match in self._special_re.finditer(text):
                pending.append(text[pos:match.start()])
                ids += self.encode_plain("".join(pending)) if any(pending) else []
                pending = []
                ids.append(self._special_ids[match.group()])
                pos = match.end()
            pending.append(text[pos:])
        return ids + (self.encode_plain("".join(pending)) if any(pending) else [])

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
