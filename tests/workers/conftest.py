"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def randperms(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every `torch.randperm` drawn during the test (the mini-batch shuffles), in order."""
    calls: list[list[int]] = []
    real = torch.randperm

    def recording(n, *args, **kwargs):
        out = real(n, *args, **kwargs)
        calls.append(out.tolist())
        return out

    monkeypatch.setattr(torch, "randperm", recording)
    return calls
