"""Attention families: who turns a `StepBatch` into the metadata of a set of layers.

A model declares, per layer, the name of the family that serves it
(``model.layer_families``, e.g. ``("paged", "paged", ...)``). The engine builds one family
object per name; each step the runner asks every family once for its plan
(``family.plan(step)``) and hands the model ``{name: plan}``; each layer passes its own
family's plan to its attention kernel. A family never sees another family's tensors.

* `PagedFamily` (``"paged"``): the `kvplan.backends.AttentionMetadata` contract (vanilla,
  ragged or block offsets), for dense and sliding-window layers. Its block tables come from
  the `kvplan.cache.KVCacheManager`, keyed by ``step.request_ids``.

A further family (e.g. the hybrid one of `kvplan.backends.hybrid`, planned by `kvplan.plan`)
is one more class with the same two methods, registered under its name when the engine is
built; the runner and the paged family do not change.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvplan.engine.step import StepBatch

PAGED = "paged"


class AttentionFamily(Protocol):
    """One attention family of an engine (module docstring)."""

    name: str

    def plan(self, step: StepBatch) -> Any:
        """The metadata this family's layers read during ``step`` (host work and staged
        copies only: no device sync)."""
        ...

    def free(self, request_id: Any) -> None:
        """Forget the per-request state of a finished or preempted request (its KV blocks
        are freed by the cache manager)."""
        ...


class PagedFamily:
    """The paged backends' family: one `AttentionMetadata` object, re-planned every step.

    ``plan`` sets the step's fields together (``AttentionMetadata.set_step``, which checks
    them before changing anything), then ``prepare()``. The same object
    is returned every step (its device buffers keep their addresses for CUDA graphs).
    """

    name = PAGED

    def __init__(self, metadata: Any, recent: Any = None) -> None:
        self.metadata = metadata
        # kv_exact_window: the ring slots (`kvplan.cache.recent_window.RecentWindow`) or None
        self.recent = recent

    def plan(self, step: StepBatch) -> Any:
        md = set_paged_step(
            self.metadata,
            step.request_ids,
            step.prompt_lens,
            step.num_cached_tokens,
            step.num_query_tokens,
            step.num_contexts,
        )
        if self.recent is not None:
            md.recent = self.recent.plan(
                step.request_ids, step.num_cached_tokens, step.num_query_tokens
            )
        return md

    def free(self, request_id: Any) -> None:
        """Release the request's recent-window ring slot (the metadata holds no block table
        between steps)."""
        if self.recent is not None:
            self.recent.free(request_id)


def set_paged_step(
    metadata: Any,
    request_ids: list[Any],
    prompt_lens: list[int],
    num_cached_tokens: Any,
    num_query_tokens: Any,
    num_contexts: int,
) -> Any:
    """Write one step's facts into ``metadata`` (an `AttentionMetadata`) with its
    ``set_step`` and ``prepare()`` it; returns ``metadata``.

    ``num_cached_tokens`` / ``num_query_tokens``: int32 ``[num_seqs]`` (context rows
    first, ``num_contexts`` of them). For callers without a `StepBatch` (CUDA-graph capture
    dummies, teacher-forced scoring).
    """
    metadata.set_step(request_ids, prompt_lens, num_cached_tokens, num_query_tokens, num_contexts)
    metadata.prepare()
    return metadata
