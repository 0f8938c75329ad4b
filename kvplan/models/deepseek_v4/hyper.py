"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

A block's residual state is ``s [T, n, hidden]`` (``n = hc_mult``; the embedding is copied to
every stream). Before a block (attention or MoE) a `HyperConnection` reads all streams::

    f        = RMSNorm(s.flatten(1)) @ fn^T      # [T, (2+n)*n], fp32, unweighted, rms_norm_eps
    pre      = sigmoid(f[:n] * scale[0] + base[:n]) + eps               # [T, n]
    post     = 2 * sigmoid(f[n:2n] * scale[1] + base[n:2n])             # [T, n]
    comb     = softmax_row(f[2n:] * scale[2] + base[2n:]) + eps         # [T, n, n]
    comb     = Sinkhorn(comb): divide columns by their sums (+eps), then
               hc_sinkhorn_iters - 1 rounds of (rows, then columns)
    x        = sum_i pre[i] * s[i]                          # the block input
    s'[k]    = post[k] * block(x) + sum_j comb[j, k] * s[j] # note: comb is used transposed

After the last layer the `HyperHead` collapses the streams with its own ``pre`` weights
(``sigmoid(f * hc_scale + hc_base) + eps``, ``f = RMSNorm(s.flatten) @ hc_fn^T``).

The arithmetic lives in `kvplan.ops.hyper_connection` (torch path on CPU, a few Triton kernels
per call on CUDA). A residual update followed by the next block's connection runs as one op
(`HyperConnection.post_pre`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvplan.ops.hyper_connection import Norm, hc_head, hc_post, hc_post_pre, hc_pre


class HyperConnection(nn.Module):
    """The mHC weights in front of one block (parameters kept in fp32)."""

    def __init__(self, hidden: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, sinkhorn_iters, hc_eps, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(
        self, s: torch.Tensor, norm: Norm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``s [T, n, hidden]`` -> (``post`` fp32 ``[T, n]``, ``comb`` fp32 ``[T, n, n]``,
        block input ``x [T, hidden]`` in ``s``'s dtype); ``norm = (weight, eps)``: ``x``
        comes back through the block's input RMSNorm (fused on the Triton path, `hc_pre`)."""
        return hc_pre(
            s, self.fn, self.base, self.scale,
            iters=self.iters, hc_eps=self.hc_eps, eps=self.eps, norm=norm,
        )  # fmt: skip

    def post_pre(
        self, s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
        norm: Norm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The previous block's residual update then this connection:
        ``s' = hyper_residual(s, post, comb, out)`` and ``self(s', norm)``, as
        (``s'``, ``post'``, ``comb'``, ``x'``); one fused op (`hc_post_pre`)."""
        return hc_post_pre(
            s, post, comb, out, self.fn, self.base, self.scale,
            iters=self.iters, hc_eps=self.hc_eps, eps=self.eps, norm=norm,
        )  # fmt: skip


def hyper_residual(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``s'[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * s[t, j]`` in ``s``'s dtype."""
    return hc_post(s, post, comb, out)


class HyperHead(nn.Module):
    """Final collapse of the ``n`` streams into one row per token."""

    def __init__(self, hidden: int, hc_mult: int, hc_eps: float, eps: float) -> None:
        super().__init__()
        self.hc_eps, self.eps = hc_eps, eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, s: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
        """``s [T, n, hidden]`` -> ``[T, hidden]`` in ``s``'s dtype (through the final norm
        ``(weight, eps)`` when given, as `hc_head` fuses it)."""
        return hc_head(
            s, self.hc_fn, self.hc_base, self.hc_scale, hc_eps=self.hc_eps, eps=self.eps,
            norm=norm,
        )  # fmt: skip
