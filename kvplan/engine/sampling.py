"""Sampling: `SamplingParams` (how one request picks its tokens and when it stops) and
`sample` (one token per row of a step's logits).

Rows are independent: a seeded request draws from its own ``torch.Generator`` exactly one
``exponential_`` vector per token, so its tokens do not depend on what else shares the batch
(Gumbel-style sampling: ``argmax(p / E)`` with ``E ~ Exp(1)`` samples from ``p``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplan.engine.logprobs import MAX_LOGPROBS
from kvplan.ops.argmax import argmax_rows


def _token_ids(ids: object) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints >= 0, or a TypeError/ValueError naming it."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
    out = []
    for t in ids:
        if isinstance(t, bool):
            raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
        try:
            v = operator.index(t)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}") from None
        if v < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {ids!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    Args:
        max_tokens: most new tokens to generate (>= 1).
        temperature: 0 = greedy (the default, so outputs are reproducible); > 0 samples from
            ``softmax(logits / temperature)``.
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p``
            (1.0 = off). Ties at the boundary are kept.
        top_k: keep the ``top_k`` most likely tokens (0 or -1 = off).
        seed: per-request random seed; the same seed gives the same tokens whatever else is
            in the batch. ``None`` draws from the engine's generator.
        stop: a string or strings; generation stops when the text contains one, and the text
            is cut before it.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in text).
        ignore_eos: keep going past the model's end-of-sequence tokens.
        skip_special_tokens: drop special tokens when detokenizing.
        logprobs: for each generated token, report its logprob and the ``logprobs`` most
            likely tokens of its step (0 <= k <= 20; None = off). The logprobs are of the
            model's distribution, ``log_softmax`` of the raw logits, whatever the temperature
            or top-k / top-p (`kvplan.engine.logprobs`).
        prompt_logprobs: report the logprob of every prompt token after the first given its
            prefix, and the top ``prompt_logprobs`` tokens of that position (0 <= k <= 20;
            None = off). Such a request does not reuse cached prefix blocks (every prompt
            position must be computed).

    Example::

        SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=1, stop=["\\n\\n"])
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | tuple[str, ...] | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            if not isinstance(self.stop, (list, tuple)):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) for s in self.stop or ()):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop or ()):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


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
    """One token per row of ``logits [N, V]`` (fp32, or a narrower float widened here):
    ``[N]`` int64 on the logits device.

    ``params[i]`` and ``generators[i]`` belong to row i (``generators[i]`` None = use
    ``default_generator``).
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits has {logits.shape[0]} rows but {len(params)} params and "
            f"{len(generators)} generators were given"
        )
    greedy = argmax_rows(logits)
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
