"""``MetadataFields``: the fields of ``InputMetadata``, every tensor the attention kernels need
for one step.

Built by ``prepare_prompt`` / ``prepare_decode`` / ``prepare_decode_on_device`` (which share the
field semantics below, not the implementation). All index tensors are int32, masks bool; they
live on ``MetadataConfig.device``. ``n`` = number of sequences, ``T`` = ``total_q`` (query
rows, sequences back to back), ``W`` = ``window_size``. Per-ratio dicts are keyed by the
ratio's decimal string; ``ca`` = every ratio, ``sparse`` / ``dense`` = those ratios only.

Fields (builders: P = prompt, D = decode eager, Z = decode on device; C = in ``get_clean_list``,
rebuilt by ``compute_attn_info``):

=============================  ==================  =======  ===========================================
field                          shape               filled   meaning
=============================  ==================  =======  ===========================================
is_prompt, num_seqs, total_q   Python scalars      P D Z    step kind, ``n``, ``T``
max_seqlen_q, max_seqlen_k     Python ints         P D Z    longest query / key length in the batch
positions                      [T]                 P D Z    absolute position ``q_start + j`` of a row
input_ids                      [T]                 P D Z    P: chunk tokens; D/Z: last token + drafts
gate_force_random              [T] bool            P D Z    ``config.force_load_balance`` per row
ngram_token_ids                [T, G] or None      P D Z    Engram ids of positions ``p - g`` (g < G)
valid_token_mask               [T] bool            P D Z    False for placeholder rows
query_indices                  [T]                 P D Z    sequence index; 998244353 for placeholders
seqlens_q, seqlens_k           [n]                 P D Z    per-sequence lengths
cu_seqlens_q, cu_seqlens_k     [n + 1]             P D Z    exclusive prefix sums of the lengths
state_block_idx                P: [n]; D/Z: [T]    P D Z    SWA ring / state slot (per seq / per row)
slot_mapping_store_swa         [T]                 P D Z    ring slot to store a row's SWA KV, or -1
positions_c[ca]                P: [Nc_r]; D/Z: [T] P D Z    first raw position of a new compressed token
slot_mapping_store_ca[ca]      same as positions_c P D Z    paged slot of that compressed token, or -1
cu_compressed_seqlens_q[ca]    [n + 1]             P        rows of positions_c per sequence
cu_compressed_seqlens[ca]      [n + 1]             P        rows per sequence in the loaded buffer
load_segments_ca[ca]           [S_r, 4]            P        load plan of the compressed history
total_k_compressed[ca]         Python int          P        rows of that buffer (= cu[..][-1])
load_segments_swa              [S, 4]              P        load plan of the SWA history (n * W rows)
total_k_swa                    Python int          P        ``n * W``
ks[sparse], ke[sparse]         [T]                 P        row's compressed keys: buffer rows [ks, ke)
kv_swa_full_index_pivots       [T, 4]              P        (P0, P1, P2, P3): two SWA buffer ranges
kv_ca_index_offset_len[dense]  [T, 2]              P D Z    (offset, len) of the row's compressed keys
context_lens                   [T]                 D Z      ``p + 1`` keys visible to the row
klen[sparse]                   [T]                 D Z (P)  compressed keys visible: ``(p + 1) // r``
kv_swa_index_offset_len        [T, 2]              D Z      (ring slot of the window start, length)
block_tables                   [T, max_num_blocks] D Z      the row's sequence's table; later cols unset
kv_ca_index[dense]             [T, width_r]        C        expanded compressed key indices, -1 pad
kv_ca_index_len[dense]         [T]                 C        ``kv_ca_index_offset_len[..][:, 1]``
kv_swa_full_index              [T, W]              C (P)    expanded prompt SWA buffer rows, -1 pad
kv_swa_index                   [T, W]              C (D Z)  expanded decode SWA ring slots, -1 pad
=============================  ==================  =======  ===========================================

Index semantics (see ``prompt.py`` / ``decode.py`` for diagrams):

* Prompt buffers: the SWA kernel reads one concatenated buffer ``[n * W history rows |
  T chunk rows]``; sequence ``i``'s history rows start at ``i * W`` and hold positions
  ``[q_start - W, q_start)``; chunk row ``cu_seqlens_q[i] + k`` holds position ``q_start + k``.
  The compressed buffer of ratio ``r`` holds sequence ``i``'s compressed tokens ``0 ..`` from
  row ``cu_compressed_seqlens[r][i]``. ``ks/ke`` and prompt ``kv_ca_index_offset_len`` index it.
* Decode ``kv_ca_index_offset_len[r]`` = ``(row * max_num_blocks * tpb, (p + 1) // r)`` with
  ``tpb = block_size // r``: position ``x = offset + k`` of the flattened ``block_tables``
  expands to slot ``block_tables.flat[x // tpb] * tpb + x % tpb``.
* ``klen`` is not in the clean list for decode (the on-device kernel writes it into its
  stacked buffers); ``compute_attn_info`` fills it when empty (prompt: ``ke - ks``; decode:
  ``context_lens // r``), so views that clear it get it back.

Other modules add fields (CP mirror: ``mirror_cp_index``, ``positions_cp``, ...; YoCo:
``yoco_*``); flatten / broadcast / copy handle every attribute of the instance.

``InputMetadata`` (``metadata.py``) adds the methods that delegate to the modules working on
these fields (``attn_info``, ``cp_mirror``, ``yoco``, ``distributed``); those modules see
only this base class, so none of them imports ``metadata.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch

_DERIVED = ("kv_ca_index", "kv_ca_index_len", "kv_swa_index", "kv_swa_full_index")


@dataclass(eq=False)
class MetadataFields:
    """See the module docstring for every field; ``None`` / ``{}`` means "not for this step"."""

    is_prompt: bool = False
    num_seqs: int = 0
    total_q: int = 0
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    positions: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    gate_force_random: torch.Tensor | None = None
    ngram_token_ids: torch.Tensor | None = None
    valid_token_mask: torch.Tensor | None = None
    query_indices: torch.Tensor | None = None
    seqlens_q: torch.Tensor | None = None
    seqlens_k: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    state_block_idx: torch.Tensor | None = None
    slot_mapping_store_swa: torch.Tensor | None = None
    positions_c: dict[str, torch.Tensor] = field(default_factory=dict)
    slot_mapping_store_ca: dict[str, torch.Tensor] = field(default_factory=dict)
    cu_compressed_seqlens_q: dict[str, torch.Tensor] = field(default_factory=dict)
    cu_compressed_seqlens: dict[str, torch.Tensor] = field(default_factory=dict)
    load_segments_ca: dict[str, torch.Tensor] = field(default_factory=dict)
    total_k_compressed: dict[str, int] = field(default_factory=dict)
    load_segments_swa: torch.Tensor | None = None
    total_k_swa: int = 0
    ks: dict[str, torch.Tensor] = field(default_factory=dict)
    ke: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_swa_full_index_pivots: torch.Tensor | None = None
    kv_ca_index_offset_len: dict[str, torch.Tensor] = field(default_factory=dict)
    context_lens: torch.Tensor | None = None
    klen: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_swa_index_offset_len: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    kv_ca_index: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_ca_index_len: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_swa_full_index: torch.Tensor | None = None
    kv_swa_index: torch.Tensor | None = None

    # ---- derived fields ---------------------------------------------------------------------
    def get_clean_list(self) -> list[str]:
        """Fields derived by ``compute_attn_info``; cleared before a CUDA-graph replay."""
        names = list(_DERIVED)
        if self.is_prompt:
            names.append("klen")  # prompt klen is ke - ks (decode builders own theirs)
        return names

    def clean(self) -> None:
        """Clear every ``get_clean_list`` field (dicts become empty, tensors ``None``)."""
        for name in self.get_clean_list():
            setattr(self, name, {} if isinstance(getattr(self, name, None), dict) else None)


# A function that rewrites a metadata object in place (or copies it) returns the same type.
Meta = TypeVar("Meta", bound=MetadataFields)
