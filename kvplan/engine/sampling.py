"""Sampling: `SamplingParams` (how one request picks its tokens and when it stops) and
`sample` (one token per row of a step's logits).

Rows are independent: a seeded request draws from its own ``torch.Generator`` exactly one
``exponential_`` vector per token, so its tokens do not depend on what else shares the batch
(Gumbel-style sampling: ``argmax(p / E)`` with ``E ~ Exp(1)`` samples from ``p``).

Logit adjustments (`apply_penalties`), in this order, on the fp32 logits of a row before its
temperature, top-k / top-p and draw (or argmax at temperature 0)::

    repetition_penalty r (every token of the prompt and the output so far, once each):
        l -> l / r if l > 0 else l * r                       (Hugging Face's rule)
    frequency_penalty f, presence_penalty p (c = the token's count in the output so far):
        l -> l - f * c - p * (c > 0)                         (OpenAI's rule)
    logit_bias b:  l -> l + b[token]
    min_tokens m: while the output holds fewer than m tokens, the request's stop token ids
        and (unless ignore_eos) the model's EOS ids -> -inf   (HF's min_new_tokens)

A request with any of them is not `SamplingParams.greedy` (the token is not the argmax of
the raw logits), so it takes none of the greedy fast paths (async launch, n-gram drafts).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvplan.engine.json_schema import JsonSchema
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


MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values (OpenAI's range)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or ``(token, bias)`` pairs) as pairs sorted by token id, or a
    TypeError/ValueError naming the bad entry."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)):
        items = bias
    else:
        raise TypeError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise TypeError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
        token, value = item
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"logit_bias: token ids must be ints >= 0, got {token!r}")
        token = int(token)  # numpy ints too
        value = _number(f"logit_bias[{token}]", value)
        if abs(value) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value}"
            )
        if token in out:
            raise ValueError(f"logit_bias: token id {token} is given twice")
        out[token] = value
    return tuple(sorted(out.items()))


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
        presence_penalty: subtracted from the logit of every token the output holds
            (in [-2, 2]; 0 = off).
        frequency_penalty: times a token's count in the output, subtracted from its logit
            (in [-2, 2]; 0 = off).
        repetition_penalty: divides the positive logits (multiplies the negative ones) of every
            token in the prompt or the output (> 0; 1 = off).
        logit_bias: ``{token_id: bias}`` added to those logits (bias in [-100, 100]; -100
            in effect bans a token, 100 forces it). Token ids are checked against the model's
            vocabulary when the request is added.
        min_tokens: fewest new tokens before EOS, a stop token id or a stop string may end
            the request (0 <= min_tokens <= max_tokens; 0 = off): until then those token
            ids cannot be sampled and stop strings are not looked for.
        json_mode: the completion is one JSON object (OpenAI's ``response_format={"type":
            "json_object"}``): at each step only tokens that keep the text a prefix of a JSON
            object can be sampled, and once the object is closed only EOS
            (`kvplan.engine.json_mode`; needs the engine's tokenizer; not with ``ignore_eos``
            or ``min_tokens``). A completion cut by ``max_tokens`` is an unfinished object.
        json_schema: the completion is one JSON value this JSON schema accepts (OpenAI's
            ``response_format={"type": "json_schema", ...}``'s ``schema``): a dict, its JSON
            text or a `kvplan.engine.json_schema.JsonSchema` (the supported subset is listed
            there; anything else raises ValueError naming its path). Turns ``json_mode`` on,
            with its rules.
        The adjustments apply in that order (module docstring), JSON mode last; the reported
        logprobs stay those of the raw logits.

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    json_mode: bool = False
    json_schema: Any = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            _number(name, getattr(self, name))
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
        for name in ("ignore_eos", "skip_special_tokens", "json_mode"):
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if abs(value) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
            object.__setattr__(self, name, value)
        value = _number("repetition_penalty", self.repetition_penalty)
        if value <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {value}")
        object.__setattr__(self, "repetition_penalty", value)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.json_schema is not None:
            if not isinstance(self.json_schema, JsonSchema):
                object.__setattr__(self, "json_schema", JsonSchema(self.json_schema))
            object.__setattr__(self, "json_mode", True)
        if self.json_mode and (self.ignore_eos or self.min_tokens):
            raise ValueError(
                "json_mode ends the request with EOS right after the object: it cannot take "
                f"ignore_eos={self.ignore_eos} or min_tokens={self.min_tokens}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a logit bias, ``min_tokens`` or JSON mode changes the logits
        before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.json_mode
        )

    @property
    def greedy(self) -> bool:
        """The token is the argmax of the raw logits: temperature 0 and no logit adjustment."""
        return self.temperature == 0.0 and not self.adjusts_logits

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


def prompt_token_mask(prompt_ids: Sequence[int], vocab: int, device) -> torch.Tensor:
    """``[vocab]`` bool on ``device``: the tokens a prompt holds (a request's repetition
    penalty reads it every step; computed once per request)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.as_tensor(list(prompt_ids), dtype=torch.int64)] = True
    return mask.to(device)


def _padded(lists: Sequence[Sequence[int]], values=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``[R, W]`` int64 ids (padding: 0) and fp32 weights (``values``, default 1; padding
    0), so that a ``scatter_add_`` adds nothing for the padding."""
    width = max(1, max((len(x) for x in lists), default=0))
    ids = torch.zeros(len(lists), width, dtype=torch.int64)
    w = torch.zeros(len(lists), width, dtype=torch.float32)
    for i, x in enumerate(lists):
        if len(x):
            ids[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
            w[i, : len(x)] = 1.0 if values is None else torch.as_tensor(values[i])
    return ids, w


class RowHistory(NamedTuple):
    """What a row's logit adjustments read of its request: ``prompt`` (token ids, or its
    `prompt_token_mask`), ``output`` (the tokens so far), ``banned`` (the ids `min_tokens`
    keeps out at this step) and ``allowed`` (JSON mode's bool ``[V]`` numpy mask of the
    tokens that may come; None: every token)."""

    prompt: Sequence[int] | torch.Tensor
    output: Sequence[int]
    banned: Sequence[int] = ()
    allowed: np.ndarray | None = None


def apply_penalties_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple],
) -> torch.Tensor:
    """Rows ``[R, V]`` (fp32) after each row's repetition, frequency and presence penalties,
    logit bias, banned tokens and JSON mode's allowed set (module docstring), batched: a few
    device ops for all rows, one host -> device copy per kind. ``histories[i]``: row i's
    `RowHistory` (or a tuple of its leading fields). A new tensor (``logits`` is not
    written)."""
    histories = [RowHistory(*h) for h in histories]
    dev, (rows, vocab) = logits.device, logits.shape
    out = logits.clone()
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        none = torch.zeros(vocab, dtype=torch.bool, device=dev)
        masks = []
        for h, r in zip(histories, rep):
            prompt = h.prompt
            if r != 1.0 and not isinstance(prompt, torch.Tensor):
                prompt = prompt_token_mask(prompt, vocab, dev)
            masks.append(prompt if r != 1.0 else none)
        seen = torch.stack(masks)  # one copy for all rows
        ids, w = _padded([h.output if r != 1.0 else () for h, r in zip(histories, rep)])
        seen |= torch.zeros(rows, vocab, device=dev).scatter_add_(1, ids.to(dev), w.to(dev)) > 0
        r = torch.tensor(rep, dtype=out.dtype).to(dev)[:, None]
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(freq) or any(pres):
        ids, w = _padded([h.output if f or q else () for h, f, q in zip(histories, freq, pres)])
        counts = torch.zeros(rows, vocab, device=dev).scatter_add_(1, ids.to(dev), w.to(dev))
        f = torch.tensor(freq, dtype=out.dtype).to(dev)[:, None]
        q = torch.tensor(pres, dtype=out.dtype).to(dev)[:, None]
        out -= f * counts + q * (counts > 0)
    if any(p.logit_bias for p in params):
        ids, w = _padded([[t for t, _ in p.logit_bias] for p in params],
                         [[b for _, b in p.logit_bias] for p in params])  # fmt: skip
        out.scatter_add_(1, ids.to(dev), w.to(dev))
    banned = [(i, t) for i, h in enumerate(histories) for t in h.banned]
    if banned:
        at = torch.tensor(banned, dtype=torch.int64).to(dev)
        out[at[:, 0], at[:, 1]] = float("-inf")
    guided = [i for i, h in enumerate(histories) if h.allowed is not None]
    if guided:  # JSON mode: every token outside the row's allowed set is out
        allowed = torch.from_numpy(np.stack([histories[i].allowed for i in guided])).to(dev)
        rows_at = torch.tensor(guided, dtype=torch.int64).to(dev)
        out[rows_at] = out[rows_at].masked_fill(~allowed, float("-inf"))
    return out


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] | torch.Tensor,
    output_ids: Sequence[int],
    banned: Sequence[int] = (),
) -> torch.Tensor:
    """`apply_penalties_rows` of one row ``[V]``."""
    history = RowHistory(prompt_ids, output_ids, banned)
    return apply_penalties_rows(logits[None], [params], [history])[0]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    histories: Sequence[tuple | None] | None = None,
) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (fp32, or a narrower float widened here):
    ``[N]`` int64 on the logits device.

    ``params[i]`` and ``generators[i]`` belong to row i (``generators[i]`` None = use
    ``default_generator``); ``histories[i]``: row i's `RowHistory` (or a tuple of its
    leading fields), needed where ``params[i].adjusts_logits``.
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
    x = logits.float()
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        if histories is None or len(histories) != len(params):
            raise ValueError("sample: rows with penalties or logit_bias need their histories")
        if any(histories[i] is None for i in adjusted):
            raise ValueError("sample: a row with penalties or logit_bias has no history")
        x = x.clone() if x is logits else x
        rows = torch.tensor(adjusted, device=dev)
        x[rows] = apply_penalties_rows(
            x[rows], [params[i] for i in adjusted], [histories[i] for i in adjusted]
        )
    temp = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev, dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    scaled = apply_top_k_top_p(x / temp[:, None], top_k, top_p)
    probs = scaled.softmax(dim=-1)
    out = greedy.clone()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        if p.temperature == 0.0:  # adjusted logits, no draw
            out[i] = x[i].argmax()
            continue
        gen = generators[i] or default_generator
        noise = torch.empty_like(probs[i]).exponential_(generator=gen)
        out[i] = (probs[i] / noise).argmax()
    return out
