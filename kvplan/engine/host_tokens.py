"""Sampled tokens, device -> host: one non-blocking copy per step into pinned memory.

Two pinned slots are used in turn, so that with async scheduling (step k + 1 launched before
step k's tokens are read) the copy of step k + 1 never overwrites step k's tokens: the slot
of step k is written again by step k + 2, which is launched only after step k was read.
"""

from __future__ import annotations

import torch

Pending = tuple[torch.Tensor, "torch.cuda.Event | None"]


class TokenCopies:
    """Start (`start`) and finish (`wait`) the host copies of sampled token tensors."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]  # pinned int64 [>= n]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

    def start(self, tokens: torch.Tensor) -> Pending:
        """Start copying ``tokens [N]`` (int64, on the device) to the host.

        On CUDA the copy goes non-blocking into the next pinned slot with one event recorded
        after it (`wait` waits on that event, not on the whole device); CPU tensors are
        returned as they are.
        """
        if tokens.device.type != "cuda":
            return tokens, None
        i = self._slot
        self._slot ^= 1
        n = tokens.shape[0]
        buf = self._bufs[i]
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[i] = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            self._events[i] = torch.cuda.Event()
        buf[:n].copy_(tokens, non_blocking=True)
        event = self._events[i]
        event.record()
        return buf[:n], event

    @staticmethod
    def wait(pending: Pending | None) -> list[int]:
        """The tokens of a `start` as Python ints (``[]`` for None: the step sampled none)."""
        if pending is None:
            return []
        host, event = pending
        if event is not None:
            event.synchronize()
        return host.tolist()
