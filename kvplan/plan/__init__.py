"""Planning: per-sequence scheduler state (``SequenceMetadata``) -> ``InputMetadata``.

* ``prepare_prompt``  -- chunked prefill (load plans, ks/ke, SWA pivots; ``kvplan.plan.prompt``);
* ``prepare_decode``  -- eager decode, vectorized on the host (``kvplan.plan.decode``);
* ``prepare_decode_on_device`` -- O(n_seq) host extraction + one Triton kernel
  (``kvplan.plan.decode_device``).

Names are imported lazily (``import kvplan.plan`` stays cheap and never pulls in Triton).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "MetadataConfig": "kvplan.plan.config",
    "SequenceMetadata": "kvplan.plan.sequence",
    "InputMetadata": "kvplan.plan.metadata",
    "prepare_prompt": "kvplan.plan.prompt",
    "prepare_decode": "kvplan.plan.decode",
    "prepare_decode_on_device": "kvplan.plan.decode_device",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
