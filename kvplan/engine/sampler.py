"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds.

Rows are independent: a seeded request draws from its own ``torch.Generator`` exactly one
``exponential_`` vector per token, so its tokens do not depend on what else shares the batch
(Gumbel-style sampling: ``argmax(p / E)`` with ``E ~ Exp(1)`` samples from ``p``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplan.engine.sampling import SamplingParams


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask ``logits [N, V]`` (fp32) outside each row's top-k / top-p set with ``-inf``.

    ``top_k [N]`` int64 (``<= 0`` or ``>= V`` = off), ``top_p [N]`` fp32 (1.0 = off). The
    top-p set is the shortest prefix of the sorted distribution whose mass reaches ``top_p``
    (the most likely token is always kept).
    """
    n, v = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(v, device=logits.device).expand(n, v)
    k = torch.where((top_k <= 0) | (top_k > v), v, top_k)
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (fp32): ``[N]`` int64 on the logits device.

    ``params[i]`` and ``generators[i]`` belong to row i (``generators[i]`` None = use
    ``default_generator``).
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits has {logits.shape[0]} rows but {len(params)} params and "
            f"{len(generators)} generators were given"
        )
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev = logits.device
    temp = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev, dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    scaled = apply_top_k_top_p(logits.float() / temp[:, None], top_k, top_p)
    probs = scaled.softmax(dim=-1)
    out = greedy.clone()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        gen = generators[i] or default_generator
        noise = torch.empty_like(probs[i]).exponential_(generator=gen)
        out[i] = (probs[i] / noise).argmax()
    return out
