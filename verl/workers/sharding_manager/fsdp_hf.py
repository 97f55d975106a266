"""Hold an FSDP2 module unsharded for the whole of a generation call.

Generation runs a different number of forward passes on each rank (a rank whose
sequences all hit EOS stops early). If every forward all-gathered its
parameters, ranks would issue different numbers of collectives and hang. So the
parameters are gathered once on entry (the same collectives on every rank),
kept gathered through all forwards, and resharded on exit.

    with FSDPUnshardedForGeneration(actor_module):
        out = rollout.generate_sequences(prompts)
"""

from __future__ import annotations

from torch import nn

from verl.utils import device as device_utils

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch
    FSDPModule = ()  # type: ignore[assignment,misc]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """Every FSDP2-wrapped submodule of `module`, the root included (parents before children)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _reshards_after_forward(module: nn.Module) -> bool:
    """Whether this FSDP2 module frees its gathered parameters after forward (so it can be restored)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group is None or group.post_forward_mesh_info is not None


class FSDPUnshardedForGeneration:
    """Context manager: unshard once before generation, reshard after (no-op for a plain module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._wrapped = fsdp_modules(module)

    def __enter__(self) -> FSDPUnshardedForGeneration:
        self._reshard_before = [_reshards_after_forward(m) for m in self._wrapped]
        for m in self._wrapped:
            m.unshard()
        for m in self._wrapped:
            # Keep the gathered parameters after each forward: later forwards then issue no collective.
            m.set_reshard_after_forward(False, recurse=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for m, reshard_after in zip(self._wrapped, self._reshard_before, strict=True):
            m.reshard()
            m.set_reshard_after_forward(reshard_after, recurse=False)
        # The KV cache, logits and gathered parameters of generation are free now.
        device_utils.empty_cache()


# veRL's name for the hybrid-engine manager.
FSDPHFShardingManager = FSDPUnshardedForGeneration
