"""Shared helpers of the fused-kernel tests: random cases, float64 references, a test model."""

from __future__ import annotations

import math

import torch

from kvplan.models.llama import LlamaForCausalLM

# Where the Triton kernels run: the GPU when there is one, else the interpreter on the CPU
# (tests/conftest.py sets TRITON_INTERPRET=1 there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator (cases are drawn on the CPU, then moved)."""
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32, device=DEVICE, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float64."""
    x = x.double()
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, D] rotated pairwise: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), c/s [T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    c, s = cos.double()[:, None, :half], sin.double()[:, None, :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qkv_case(seed, t, h, hkv, d, norm, dtype=torch.float32, device=DEVICE, max_pos=40):
    """Random ``(qkv, positions, cos, sin), kwargs`` for `qkv_epilogue` (cos/sin tables of
    random angles, duplicated over both halves as `RotaryTable` builds them)."""
    g = gen(seed)
    qkv = randn(g, t, (h + 2 * hkv) * d, dtype=dtype, device=device, scale=2.0)
    ang = torch.rand(max_pos, d // 2, generator=g) * 2 * math.pi
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype=dtype, device=device)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dtype=dtype, device=device)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    kw = dict(num_heads=h, num_kv_heads=hkv)
    if norm:
        kw.update(q_norm_weight=randn(g, d, dtype=dtype, device=device),
                  k_norm_weight=randn(g, d, dtype=dtype, device=device), eps=1e-5)  # fmt: skip
    return (qkv, pos, cos, sin), kw


class DenseCausal:
    """Test attention backend: the step is one sequence from position 0, causal, no cache."""

    def __init__(self, layer_idx, num_heads, num_kv_heads, head_dim, *, scale, sliding_window):
        self.group, self.scale = num_heads // num_kv_heads, scale

    def forward(self, q, k, v, metadata):
        assert q.is_contiguous() and k.is_contiguous()
        k, v = (x.repeat_interleave(self.group, dim=1).float() for x in (k, v))
        s = torch.einsum("thd,shd->hts", q.float(), k) * self.scale  # [H, T, T]
        t = q.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", p, v).to(q.dtype)


def model_with_random_weights(
    cfg, seed, dtype=torch.float32, device=DEVICE, **kw
) -> LlamaForCausalLM:
    """A model on `DenseCausal` with O(1) activations: unit-gain matrices, norm weights
    ``1 + 0.2 N(0, 1)`` (so that every weight multiply matters), random biases/embeddings."""
    model = LlamaForCausalLM(cfg, DenseCausal, max_positions=64, dtype=dtype, device=device, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                r = 1 + 0.2 * torch.randn(p.shape, generator=g)
            elif p.dim() == 2 and "embed" not in name:
                r = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            else:
                r = torch.randn(p.shape, generator=g) * 0.5
            p.copy_(r)
    return model
