"""The step broadcast: what rank 0 sends the other ranks, and how they plan from it.

Rank 0 owns the scheduler and the KV cache manager; the other ranks own only their model
shard, their KV heads' cache and a metadata object of the same backend. Rather than
broadcasting the paged metadata (an `AttentionMetadata` keeps host state, staging buffers and
a manager, not a flat set of tensors), rank 0 broadcasts the step's host facts and each rank
plans locally with the same deterministic ``set_step`` + ``prepare()``:

* the facts `kvplan.engine.families.set_paged_step` takes (request ids, prompt lengths,
  cached and query token counts, ``num_contexts``);
* the batch's rows of the manager's block tables (int32 ``[num_pools, n,
  max_blocks_per_seq]``) and their allocated counts, which a `MirrorManager` hands to the
  metadata in place of the manager's ``batch_tables``;
* the model inputs: token ids and positions ``[T]``, logits rows ``[N]`` (or none = all).

A message travels as two broadcasts from rank 0: a fixed int64 header ``[HEADER_LEN]`` (kind
and sizes), then one int64 payload when it has any. Kinds: ``PING`` (keeps idle ranks'
waits inside the collective timeout), ``STEP`` (plan + forward: ``ModelRunner.execute``),
``PLAN`` and ``FORWARD`` (``runner.plan`` and ``runner.model`` called separately, e.g. by
`kvplan.engine.scoring`), ``SHUTDOWN``.

A family whose metadata is a flat object of tensors (the hybrid family's
`kvplan.plan.InputMetadata`) can instead send it with its own ``broadcast`` between the
header and the forward; that is the path the DeepSeek-V4 model would take.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvplan.cache.batch_tables import BatchTables

HEADER_LEN = 10


class Kind(enum.IntEnum):
    PING = 0
    STEP = 1
    PLAN = 2
    FORWARD = 3
    SHUTDOWN = 4


@dataclass
class StepFacts:
    """One step's planning facts (module docstring); arrays are host numpy."""

    request_ids: list[int]
    prompt_lens: list[int] | None
    num_cached_tokens: np.ndarray  # int32 [n]
    num_query_tokens: np.ndarray  # int32 [n]
    num_contexts: int
    tables: np.ndarray  # int32 [num_pools, n, max_blocks_per_seq]
    num_allocated: np.ndarray  # int32 [n]

    @classmethod
    def of(cls, step: Any, manager: Any) -> StepFacts:
        """The facts of a `StepBatch` whose block tables ``manager`` holds."""
        bt = manager.batch_tables(step.request_ids, 1, step.num_contexts)
        return cls(
            [int(r) for r in step.request_ids],
            None if step.prompt_lens is None else [int(p) for p in step.prompt_lens],
            np.asarray(step.num_cached_tokens, dtype=np.int32),
            np.asarray(step.num_query_tokens, dtype=np.int32),
            int(step.num_contexts),
            bt.tables[:, bt.rows],
            bt.num_allocated[bt.rows].astype(np.int32),
        )


@dataclass
class Message:
    """A received message: ``facts`` for STEP / PLAN, the inputs (on the receiving device)
    for STEP / FORWARD."""

    kind: Kind
    facts: StepFacts | None = None
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None


def _i64(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64).reshape(-1))


def send(
    kind: Kind,
    device: torch.device,
    facts: StepFacts | None = None,
    inputs: tuple[Any, Any, Any] | None = None,
    group: Any = None,
) -> None:
    """Broadcast one message from rank 0. ``inputs``: (input ids, positions, logits rows or
    None), each a tensor or array."""
    import torch.distributed as dist

    header = [0] * HEADER_LEN
    header[0] = int(kind)
    parts: list[torch.Tensor] = []
    if facts is not None:
        p, n, w = facts.tables.shape
        header[1:6] = [n, facts.num_contexts, p, w, int(facts.prompt_lens is not None)]
        parts += [_i64(facts.request_ids), _i64(facts.num_cached_tokens)]
        parts += [_i64(facts.num_query_tokens), _i64(facts.tables), _i64(facts.num_allocated)]
        if facts.prompt_lens is not None:
            parts.append(_i64(facts.prompt_lens))
    if inputs is not None:
        ids, pos, rows = inputs
        header[6:9] = [len(ids), -1 if rows is None else len(rows), 1]
        parts += [_i64(ids).to("cpu"), _i64(pos).to("cpu")]
        if rows is not None:
            parts.append(_i64(rows).to("cpu"))
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0, group=group)
    if parts:
        payload = torch.cat(parts).to(device)
        dist.broadcast(payload, src=0, group=group)


def recv(device: torch.device, group: Any = None) -> Message:
    """Receive one message on a rank other than 0 (blocks in the header broadcast)."""
    import torch.distributed as dist

    header_t = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header_t, src=0, group=group)
    header = header_t.tolist()
    kind = Kind(header[0])
    n, nc, p, w, has_prompt = header[1:6]
    t, num_rows, has_inputs = header[6:9]
    size = 0
    if kind in (Kind.STEP, Kind.PLAN):
        size += 3 * n + p * n * w + n + (n if has_prompt else 0)
    if has_inputs:
        size += 2 * t + max(num_rows, 0)
    msg = Message(kind)
    if size == 0:
        return msg
    payload = torch.empty(size, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0, group=group)
    at = 0

    def take(count: int) -> torch.Tensor:
        nonlocal at
        at += count
        return payload[at - count : at]

    if kind in (Kind.STEP, Kind.PLAN):
        host = payload[: 3 * n + p * n * w + n + (n if has_prompt else 0)].cpu().numpy()
        at = host.size
        i32 = lambda a: a.astype(np.int32)
        rids, cached, query = host[:n], host[n : 2 * n], host[2 * n : 3 * n]
        tables = host[3 * n : 3 * n + p * n * w].reshape(p, n, w)
        rest = host[3 * n + p * n * w :]
        msg.facts = StepFacts(
            rids.tolist(),
            rest[n:].tolist() if has_prompt else None,
            i32(cached),
            i32(query),
            nc,
            i32(tables),
            i32(rest[:n]),
        )
    if has_inputs:
        msg.input_ids = take(t)
        msg.positions = take(t)
        msg.logits_rows = take(num_rows) if num_rows >= 0 else None
    return msg


class MirrorManager:
    """A rank's stand-in for rank 0's `KVCacheManager` inside its metadata object: static
    properties (``block_size``, ``num_pools``, ``max_blocks_per_seq``, ``max_seq_len``,
    ``pool_for_layer``, ...) come from ``manager`` (a manager built like rank 0's, never
    used for bookkeeping); ``batch_tables`` returns the broadcast step's rows (``facts``)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self.facts: StepFacts | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def batch_tables(
        self, request_ids: Any, beam_width: int = 1, num_contexts: int = 0, *, cross=False
    ) -> BatchTables:
        facts = self.facts
        if facts is None:
            raise RuntimeError("MirrorManager.batch_tables before any step was received")
        if beam_width != 1 or cross:
            raise ValueError("tensor-parallel steps carry beam_width=1 self-attention tables")
        if len(request_ids) != facts.tables.shape[1]:
            raise ValueError(
                f"batch_tables for {len(request_ids)} requests; the step holds "
                f"{facts.tables.shape[1]}"
            )
        rows = np.arange(facts.tables.shape[1], dtype=np.int64)
        return BatchTables(facts.tables, rows, facts.num_allocated)
