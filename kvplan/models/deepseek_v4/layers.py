"""Small shared pieces: RMSNorms, DeepSeek-V4's interleaved partial RoPE, and `LinearGroup`
(bias-free linears that read one input, run as one GEMM).

RoPE rotates only the trailing ``rope_head_dim`` channels of a row (layout ``[nope | rope]``),
pairing *adjacent* channels ``(2i, 2i+1)`` with frequency ``inv_freq[i]``::

    y[2i]   = x[2i] * cos_i - x[2i+1] * sin_i
    y[2i+1] = x[2i+1] * cos_i + x[2i] * sin_i

Because K = V, the attention output carries the keys' rotation; the model undoes it by
applying the same table with ``-sin`` at the *query* position (`kvplan.ops.rope.norm_rope`
with ``inverse=True``).
As in Hugging Face, ``cos`` / ``sin`` are rounded to the activation dtype before the fp32
rotation, and the unweighted RMSNorm multiplies in the activation dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.models.deepseek_v4.config import RopeSpec
from kvplan.ops.rms_norm import rms_norm_fp32w
from kvplan.ops.rope import rope_cos_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim, computed in fp32 (``weight`` is kept in fp32); one
    Triton kernel on CUDA (`kvplan.ops.rms_norm.rms_norm_fp32w`)."""
    return rms_norm_fp32w(x, weight, eps)


def rope_inv_freq(rope: RopeSpec, rope_head_dim: int) -> torch.Tensor:
    """fp32 ``[rope_head_dim // 2]`` inverse frequencies of ``rope`` (default or YaRN)."""
    d = rope_head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    base = rope.theta**exponents  # [d/2]
    inv_freq = 1.0 / base
    if rope.rope_type != "yarn":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        omax = rope.original_max_position_embeddings
        return d * math.log(omax / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return (1.0 / (rope.factor * base)) * (1 - keep) + inv_freq * keep


class StepRope:
    """The ``cos`` / ``sin`` tables of one step's positions, computed once per `Rope` and
    shared by every layer of the step (``get(rope)``)."""

    def __init__(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.positions, self.dtype = positions, dtype
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(rope)
        if key not in self._tables:
            self._tables[key] = rope.cos_sin(self.positions, self.dtype)
        return self._tables[key]


class Rope(torch.nn.Module):
    """One rotary table (``inv_freq`` buffer, attention scale) over the trailing rotary dims."""

    def __init__(self, rope: RopeSpec, rope_head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, rope_head_dim), persistent=False)
        self.scale = rope.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin``: ``[T, R/2]`` in ``dtype`` for int64 ``positions [T]``."""
        return rope_cos_sin(positions, self.inv_freq, self.scale, dtype)


class LinearGroup(nn.Module):
    """Bias-free ``nn.Linear`` members that read the same input, run as one GEMM.

    The members stay registered where they belong (their parameter names, ``state_dict`` and
    the checkpoint loader do not change); the group holds them unregistered and owns no
    parameter. `fuse` copies their weights into one ``[sum(out_i), in]`` tensor and makes each
    member's ``weight`` a row slice (a view) of it, so in-place writes (``copy_``,
    ``load_state_dict``) reach the fused tensor. While every member's weight is still that view,
    `forward` is one ``F.linear`` whose ``[T, sum(out_i)]`` output is split into column views
    (unit column stride, row stride ``sum(out_i)``); once a weight was replaced (``p.data =
    ...``, a deep copy), the group drops the fused tensor and runs the members one by one
    until `fuse` is called again. Both paths give the member's own dtype and values (one GEMM
    per output column either way; only the GEMM's blocking can differ). Inference only: no
    gradient reaches the members through the fused tensor.

    Example::

        a, b = nn.Linear(8, 3, bias=False), nn.Linear(8, 5, bias=False)
        group = LinearGroup(a, b)
        group.fuse()
        ya, yb = group(torch.randn(4, 8))      # [4, 3], [4, 5]: views of one [4, 8] GEMM
    """

    def __init__(self, *members: nn.Linear) -> None:
        super().__init__()
        if not members:
            raise ValueError("LinearGroup needs at least one member")
        for i, m in enumerate(members):
            if not isinstance(m, nn.Linear) or m.bias is not None:
                raise TypeError(f"members[{i}] must be a bias-free nn.Linear, got {m!r}")
            if m.in_features != members[0].in_features:
                raise ValueError(
                    f"members[{i}].in_features={m.in_features} differs from "
                    f"members[0].in_features={members[0].in_features}"
                )
        self._members = tuple(members)  # a tuple: not registered as submodules
        self.sizes = tuple(m.out_features for m in members)
        self._weight: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()

    def is_fused(self) -> bool:
        """Whether every member's weight is still its view of the fused tensor."""
        return self._weight is not None and all(
            m.weight.data_ptr() == p for m, p in zip(self._members, self._ptrs)
        )

    @torch.no_grad()
    def fuse(self, storage: torch.Tensor | None = None) -> None:
        """Concatenate the members' weights (same dtype and device) into one tensor and make
        each weight a view of it; a no-op when already fused into ``storage`` (or, without
        one, into any tensor). ``storage``: the ``[sum(out_i), in]`` tensor to fuse into (a
        slice of a larger fused weight, as `DeepseekV4MoE.fuse_weights` passes); the
        weights are copied into it unless they already are its rows."""
        if self.is_fused() and (storage is None or self._weight.data_ptr() == storage.data_ptr()):
            return
        weights = [m.weight.data for m in self._members]
        for i, w in enumerate(weights):
            if (w.dtype, w.device) != (weights[0].dtype, weights[0].device):
                raise ValueError(
                    f"member {i} weight is {w.dtype} on {w.device}, member 0's "
                    f"{weights[0].dtype} on {weights[0].device}: cast them alike before fusing"
                )
        if storage is None:
            fused = torch.cat(weights, dim=0)  # [sum(out_i), in]
        else:
            want = (sum(self.sizes), weights[0].shape[1])
            if tuple(storage.shape) != want or storage.dtype != weights[0].dtype:
                raise ValueError(
                    f"storage must be {weights[0].dtype} {want}, got {storage.dtype} "
                    f"{tuple(storage.shape)}"
                )
            fused = storage
            for w, rows in zip(weights, fused.split(self.sizes, dim=0)):
                if w.data_ptr() != rows.data_ptr():
                    rows.copy_(w)
        for m, rows in zip(self._members, fused.split(self.sizes, dim=0)):
            m.weight.data = rows
        self._weight = fused
        self._ptrs = tuple(m.weight.data_ptr() for m in self._members)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [T, in]`` -> one ``[T, out_i]`` output per member, in ``x``'s dtype."""
        if self._weight is not None and not self.is_fused():
            self._weight, self._ptrs = None, ()  # a member was replaced: release the copy
        if self._weight is None:
            return tuple(m(x) for m in self._members)
        return F.linear(x, self._weight).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> nn.Module:
    """`LinearGroup.fuse` every group in ``model`` and ``fuse_weights()`` every module that has
    one (the MoE blocks: `kvplan.models.deepseek_v4.moe.DeepseekV4MoE.fuse_weights`),
    parents before their children (idempotent); returns ``model``."""
    for m in model.modules():
        if isinstance(m, LinearGroup):
            m.fuse()
        elif callable(getattr(m, "fuse_weights", None)):
            m.fuse_weights()
    return model
