"""``InputMetadata``: every tensor the attention kernels need for one step, and its methods.

The fields and their semantics are ``MetadataFields`` (``metadata_fields.py``). The methods
delegate to the modules that implement them: ``compute_attn_info`` (``attn_info.py``), the
CP mirror (``cp_mirror.py``), the YoCo views (``yoco.py``) and flatten / broadcast / copy
(``distributed.py``). Those modules work on ``MetadataFields`` and never import this one.
"""

from __future__ import annotations

from typing import Any

from kvplan.plan import attn_info, cp_mirror, distributed, yoco
from kvplan.plan.metadata_fields import MetadataFields


class InputMetadata(MetadataFields):
    """See ``MetadataFields`` for every field; ``None`` / ``{}`` means "not for this step"."""

    def compute_attn_info(
        self, config, out: dict | None = None, *, check: bool = False
    ) -> InputMetadata:
        """Expand the O(T) ranges into the O(T x width) index tensors (idempotent).

        Fills only empty fields; with ``out`` (capture-size buffers, see ``attn_info.py``) the
        expansion writes their prefixes in place. ``check`` lets the index ops validate their
        inputs (host syncs). Returns ``self``.
        """
        return attn_info.compute_attn_info(self, config, out=out, check=check)

    # ---- views (delegations) ----------------------------------------------------------------
    def prepare_for_mirror_cp(self, *args: Any, **kwargs: Any) -> Any:
        """CP mirror of a prompt step (``kvplan.plan.cp_mirror``)."""
        return cp_mirror.prepare_for_mirror_cp(self, *args, **kwargs)

    def get_mask_view(self, *args: Any, **kwargs: Any) -> Any:
        """YoCo mask-mode view (``kvplan.plan.yoco``)."""
        return yoco.get_mask_view(self, *args, **kwargs)

    def get_consumer_view(self, *args: Any, **kwargs: Any) -> Any:
        """YoCo compact consumer view (``kvplan.plan.yoco``)."""
        return yoco.get_consumer_view(self, *args, **kwargs)

    # ---- flatten / broadcast / copy (delegations) -------------------------------------------
    def to_flatten_dict(self) -> dict[str, Any]:
        """One level: ``{"klen.4": t, "positions": t, ...}`` (see ``distributed.py``)."""
        return distributed.to_flatten_dict(self)

    @classmethod
    def from_flatten_dict(cls, flat: dict[str, Any]) -> InputMetadata:
        """Inverse of ``to_flatten_dict``."""
        return distributed.from_flatten_dict(cls, flat)

    def broadcast(self, src: int = 0, group: Any = None) -> InputMetadata:
        """Broadcast over ``torch.distributed`` (see ``distributed.py``); returns ``self``."""
        return distributed.broadcast(self, src=src, group=group)

    def recursive_copy_(self, other: InputMetadata) -> InputMetadata:
        """Copy ``other``'s tensors into this object's tensors in place (see ``distributed.py``).

        Only tensors and one level of dicts of tensors are copied; scalar fields (``total_q``,
        ``num_seqs``, ``is_prompt``, ...) are NOT copied: the caller updates them.
        """
        return distributed.recursive_copy_(self, other)
