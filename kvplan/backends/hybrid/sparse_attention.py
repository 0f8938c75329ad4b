"""Dense torch stand-ins for the hybrid family's kernels: attention over gathered rows with
sinks, and the indexer's top-k.

Both read a row buffer plus a per-query index table (``-1`` = not visible), the shape the
sparse attention kernels of the fast path take, so a kernel can replace either function
without touching the planning.
"""

from __future__ import annotations

import torch

_ROWS_PER_CHUNK = 256  # bounds the [rows, H, K] logits held at once


def sink_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query row over its indexed K=V rows, with a per-head sink.

    Args:
        q: ``[T, H, D]`` queries (any float dtype).
        rows: ``[N, D]`` K=V rows (keys and values are the same rows).
        index: int ``[T, K]`` rows of ``rows`` visible to each query, ``-1`` = none.
        sinks: ``[H]`` per-head logits added to the softmax denominator only.
        scale: logit scale.

    Returns:
        ``[T, H, D]`` in ``q``'s dtype; the math is fp32::

            out[t, h] = sum_k exp(l_k - m) v_k / (sum_k exp(l_k - m) + exp(sinks[h] - m))
            l_k = scale * q[t, h] . rows[index[t, k]],  m = max(max_k l_k, sinks[h])
    """
    num_rows = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sink = sinks.float().view(1, -1, 1)  # [1, H, 1]
    src = rows.float()
    for lo in range(0, num_rows, _ROWS_PER_CHUNK):
        hi = min(lo + _ROWS_PER_CHUNK, num_rows)
        idx = index[lo:hi].long()  # [t, K]
        kv = src[idx.clamp(min=0)]  # [t, K, D]
        logits = torch.einsum("thd,tkd->thk", q[lo:hi].float(), kv) * scale
        logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)  # [t, H, 1]
        p = torch.exp(logits - m)
        denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
        out[lo:hi] = (torch.einsum("thk,tkd->thd", p, kv) / denom).to(q.dtype)
    return out


def indexer_topk(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: torch.Tensor,
    count: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Top-k candidates per query by the indexer score.

    Args:
        index_q: ``[T, Hi, Ci]`` indexer queries.
        index_weights: ``[T, Hi]`` per-head weights (all scalings folded in).
        keys: fp32 ``[T, K, Ci]``: row ``t``'s candidates, column ``c`` valid for
            ``c < count[t]``.
        count: int ``[T]`` valid candidates per row.
        top_k: entries kept per row.

    Returns:
        int32 ``[T, top_k]``: candidate columns, best first, ``-1`` past ``min(top_k,
        count[t])``. Score of candidate ``c``: ``sum_h index_weights[t, h] *
        relu(index_q[t, h] . keys[t, c])`` (fp32).
    """
    num_rows, width = keys.shape[0], keys.shape[1]
    out = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=keys.device)
    if width == 0 or num_rows == 0:
        return out
    dots = torch.einsum("thc,tkc->thk", index_q.float(), keys.float()).relu()
    scores = torch.einsum("thk,th->tk", dots, index_weights.float())
    col = torch.arange(width, device=keys.device)[None, :]
    valid = col < count.long()[:, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    k = min(top_k, width)
    picked = scores.topk(k, dim=-1).indices  # [T, k]
    keep = torch.arange(k, device=keys.device)[None, :] < count.long()[:, None]
    out[:, :k] = torch.where(keep, picked, -1).to(torch.int32)
    return out
