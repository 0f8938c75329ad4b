"""A request's life: its tokens, how many have KV in the cache, and why it finished."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvplan.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted for recompute)
    RUNNING = "running"  # holding blocks; prefilling or decoding
    FINISHED = "finished"


class TokenIds(Sequence[int]):
    """Read-only view of a request's tokens, the prompt then the outputs, up to ``end``.

    Indexing and ``len`` cost O(1); a prefix slice ``[:k]`` is another view, any other slice
    a list of just that range. So a planner reading one step's chunk of a long sequence does
    not copy the whole history each step. Iteration, slices and ``np.asarray`` run on the
    underlying lists at C speed (a planner turning an 8K-token prompt into an array element
    by element through ``__getitem__`` spent ~5 ms of host time a step on it).
    """

    __slots__ = ("_prompt", "_output", "_end")

    def __init__(self, prompt: list[int], output: list[int], end: int | None = None) -> None:
        self._prompt, self._output = prompt, output
        total = len(prompt) + len(output)
        self._end = total if end is None else min(end, total)

    def __len__(self) -> int:
        return self._end

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(itertools.chain(self._prompt, self._output), self._end)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self._range(0, self._end), dtype=np.int64 if dtype is None else dtype)

    def _range(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` (``0 <= start``, ``stop <= len``) as one list."""
        n = len(self._prompt)
        if stop <= n:
            return self._prompt[start:stop]
        return self._prompt[start:n] + self._output[max(start - n, 0) : stop - n]

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._end)
            if start == 0 and step == 1:
                return TokenIds(self._prompt, self._output, stop)
            if step == 1:
                return self._range(start, max(start, stop))
            return self._range(0, self._end)[index]
        if index < 0:
            index += self._end
        if not 0 <= index < self._end:
            raise IndexError(f"token index {index} outside [0, {self._end})")
        n = len(self._prompt)
        return self._prompt[index] if index < n else self._output[index - n]


@dataclass
class Request:
    """Engine-side state of one request.

    ``num_computed_tokens`` counts the tokens of ``all_token_ids`` whose K/V is in the cache.
    At admission every token it has (the prompt, plus after a preemption the tokens generated so
    far) becomes ``num_prefill_tokens``: the request is *prefilling* until those are computed
    (in chunks), then *decoding*: each step computes its newest sampled token (plus drafts).
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # tokens that must be computed by (chunked) prefill since the last admission; the rest
    # are decoded one (or 1 + drafts) at a time
    num_prefill_tokens: int = 0
    finish_reason: str | None = None
    stop_text_len: int | None = None  # cut the text here (stop string found)
    num_preemptions: int = 0
    num_cached_prefix_tokens: int = 0  # prefix-reused tokens at the last admission
    # where a prefill chunk also ends (0: nowhere): the end of the cached blocks the last
    # admission could not resume from (`Scheduler.resume_block_size`)
    resume_at: int = 0
    # where its prefill chunks also end: the ends of prefixes that waiting prompts share with
    # it and wait for (`Scheduler.wait_for_shared_prefix`, with ``resume_block_size``)
    shared_ends: list[int] = field(default_factory=list)
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    # with params.logprobs: one entry per output token; with params.prompt_logprobs: one
    # per prompt token after the first (`kvplan.engine.logprobs.TokenLogprob`)
    logprobs: list[Any] = field(default_factory=list)
    # with params.repetition_penalty: the prompt's tokens as a [vocab] bool mask on the
    # device (`kvplan.engine.sampling.prompt_token_mask`), built at the first sampled token
    prompt_token_mask: Any = None
    # JSON mode's position (`kvplan.engine.json_mode.JsonGuide`), made at the first sample
    json_guide: Any = None
    prompt_logprobs: list[Any] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_view(self) -> TokenIds:
        """``all_token_ids`` without the copy (a read-only view; see `TokenIds`)."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are still missing."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
