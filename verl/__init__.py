"""veRL's top-level names, for code written against veRL or the original Search-R1.

    from verl import DataProto

Loaded on first use (PEP 562 `__getattr__`): `import verl.utils.batch_keys` and the retrieval
server stay free of torch and tensordict, which `verl.protocol` imports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataProto"]


def __getattr__(name: str) -> Any:
    if name == "DataProto":
        from verl.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
