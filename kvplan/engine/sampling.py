"""`SamplingParams`: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop or ()):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())
