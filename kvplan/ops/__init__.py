"""GPU ops of kvplan: one module per op, Triton kernel and torch paths side by side.

Index ops (this package's public names, imported lazily so that importing one op does not
compile or import the others):

* ``convert_kv_index``          top-k logical index -> physical slot (in place)
* ``expand_swa_index``          prefill SWA pivots -> dense ``[rows, W]`` window index
* ``expand_swa_index_decode``   decode ring (start slot, length) -> ``[rows, W]`` slots
* ``kv_index_cat``              [SWA index | compressed index shifted by its base]
* ``expand_kv_ca_index``        compressed (offset, length) -> dense index, width % 128 == 0
* ``expand_kv_ca_index_decode`` the same through per-row block tables
* ``kv_ca_index_width``         that width for a given ``max_len``

Storage and attention ops:

* ``store_kv_cache`` / ``load_paged_kv_cache``  quantize + scatter by slot / load plan -> buffer
* ``paged_attention_decode`` / ``paged_attention_prefill``  attention over a flat page table

Dispatch rule: CUDA tensors run the Triton kernel, CPU tensors the vectorized torch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplan._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "convert_kv_index": "kvplan.ops.convert_kv_index",
    "expand_swa_index": "kvplan.ops.swa_index",
    "expand_swa_index_decode": "kvplan.ops.swa_index",
    "kv_index_cat": "kvplan.ops.kv_index_cat",
    "expand_kv_ca_index": "kvplan.ops.kv_ca_index",
    "expand_kv_ca_index_decode": "kvplan.ops.kv_ca_index",
    "kv_ca_index_width": "kvplan.ops.kv_ca_index",
    "store_kv_cache": "kvplan.ops.store",
    "load_paged_kv_cache": "kvplan.ops.load",
    "paged_attention_decode": "kvplan.ops.paged_attention",
    "paged_attention_prefill": "kvplan.ops.paged_attention",
    "paged_attention_ref": "kvplan.ops.paged_attention",
}

__all__ = [
    "convert_kv_index",
    "expand_kv_ca_index",
    "expand_kv_ca_index_decode",
    "expand_swa_index",
    "expand_swa_index_decode",
    "kv_ca_index_width",
    "kv_index_cat",
    "load_paged_kv_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_ref",
    "store_kv_cache",
]
assert sorted(__all__) == sorted(_EXPORTS), "kvplan.ops: __all__ and _EXPORTS disagree"


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover
    from kvplan.ops.convert_kv_index import convert_kv_index
    from kvplan.ops.kv_ca_index import (
        expand_kv_ca_index,
        expand_kv_ca_index_decode,
        kv_ca_index_width,
    )
    from kvplan.ops.kv_index_cat import kv_index_cat
    from kvplan.ops.load import load_paged_kv_cache
    from kvplan.ops.paged_attention import (
        paged_attention_decode,
        paged_attention_prefill,
        paged_attention_ref,
    )
    from kvplan.ops.store import store_kv_cache
    from kvplan.ops.swa_index import expand_swa_index, expand_swa_index_decode
