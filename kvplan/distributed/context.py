"""`TPContext`: one rank's view of a tensor-parallel group, and the divisibility rules.

A model layer that is split across ranks holds a `TPContext` (``None`` on a single device):
its ``rank`` and ``size`` pick the layer's shard, and its two collectives join the shards'
results. Everything else about the group (processes, the step broadcast) lives elsewhere in
`kvplan.distributed`; a layer never sees it.

Splits (``size`` ranks, rank ``r``):

* heads: query heads ``[r * H / size, (r + 1) * H / size)``, KV heads likewise (GQA keeps its
  ratio on every rank: ``H / Hkv`` query heads per KV head). With fewer KV heads than ranks
  (``size`` a multiple of ``Hkv``, e.g. Gemma-3-270M's one KV head on 2 ranks) each KV head
  is replicated on ``size / Hkv`` consecutive ranks: rank r holds KV head
  ``r // (size / Hkv)``, the one all its query heads read, and its cache holds that head
  (`kv_head_range`, `local_kv_heads`);
* MLP: intermediate columns ``[r * I / size, (r + 1) * I / size)``;
* vocabulary: ``per_rank = ceil(V / size)`` rows each, rank r owning token ids
  ``[r * per_rank, min(V, (r + 1) * per_rank))``; the last rank's missing rows are zero
  padding whose logits are dropped after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPContext:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks (``group``: the
    ``torch.distributed`` process group; None = the default group)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be an int in [0, {self.size}), got {self.rank!r}")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``total`` items split evenly (ValueError naming
        ``what`` when ``total`` does not divide by ``size``)."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads ``[start, end)`` of ``num_kv_heads`` (module docstring: an even
        split, or one replicated head when there are fewer KV heads than ranks)."""
        if num_kv_heads % self.size == 0:
            return self.split(num_kv_heads, "num_kv_heads")
        if self.size % num_kv_heads:
            raise ValueError(_kv_heads_message(num_kv_heads, self.size))
        head = self.rank // (self.size // num_kv_heads)
        return head, head + 1

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, end, per_rank)``: this rank's token ids ``[start, end)`` and the padded
        rows every rank holds (module docstring)."""
        per_rank = -(-vocab_size // self.size)
        start = min(vocab_size, self.rank * per_rank)
        return start, min(vocab_size, start + per_rank), per_rank

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[N, per_rank]`` logits of every rank -> ``[N, vocab_size]`` (rank order, padding
        dropped), on every rank."""
        import torch.distributed as dist

        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads a rank holds: ``num_kv_heads / size``, or 1 when replicated (module
    docstring)."""
    return max(1, num_kv_heads // size)


def _kv_heads_message(num_kv_heads: int, size: int) -> str:
    return (
        f"tensor_parallel_size={size} must divide the model's num_kv_heads={num_kv_heads} "
        "or be a multiple of it (each rank holds an equal share of the KV heads, or one "
        "replicated KV head)"
    )


def check_tensor_parallel(cfg: Any, size: int) -> None:
    """ValueError unless a dense ``cfg`` (`kvplan.models.config.ModelConfig`) splits over
    ``size`` ranks: query heads and the MLP's intermediate size must divide by it, and KV heads
    divide by it or divide it (replicated KV heads); the vocabulary need not (it is padded)."""
    if size == 1:
        return
    for name in ("num_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide the model's {name}={value} "
                "(each rank holds an equal share)"
            )
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(_kv_heads_message(kv, size))
