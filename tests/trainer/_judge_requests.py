"""Reading an LLM judge request the way its system message declares it (for scripted judge servers)."""

from __future__ import annotations

import json
import re


def prompt_fields(messages: list[dict[str, str]]) -> dict[str, str]:
    """The data blocks of a judge request by name ({question, reference, answer}: their texts)."""
    assert [m["role"] for m in messages] == ["system", "user"], messages
    nonce = re.search(r"<data-([0-9a-f]{16}) ", messages[0]["content"]).group(1)
    return {m.group(1): json.loads(m.group(2))
            for m in re.finditer(rf'<data-{nonce} name="(\w+)">(.*?)</data-{nonce}>', messages[1]["content"], re.S)}
