"""Planning: per-sequence scheduler state (``SequenceMetadata``) -> ``InputMetadata``.

* ``prepare_prompt``  -- chunked prefill (load plans, ks/ke, SWA pivots; ``kvplan.plan.prompt``);
* ``prepare_decode``  -- eager decode, vectorized on the host (``kvplan.plan.decode``);
* ``prepare_decode_on_device`` -- O(n_seq) host extraction + one Triton kernel
  (``kvplan.plan.decode_device``).

Names are imported lazily (``import kvplan.plan`` stays cheap and never pulls in Triton).
"""

from __future__ import annotations

from kvplan._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "MetadataConfig": "kvplan.plan.config",
    "SequenceMetadata": "kvplan.plan.sequence",
    "InputMetadata": "kvplan.plan.metadata",
    "prepare_prompt": "kvplan.plan.prompt",
    "prepare_decode": "kvplan.plan.decode",
    "prepare_decode_on_device": "kvplan.plan.decode_device",
    "DecodeBatchArrays": "kvplan.plan.decode_arrays",
}

__all__ = [
    "DecodeBatchArrays",
    "InputMetadata",
    "MetadataConfig",
    "SequenceMetadata",
    "prepare_decode",
    "prepare_decode_on_device",
    "prepare_prompt",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
