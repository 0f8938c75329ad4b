"""A request's life: its tokens, how many have KV in the cache, and why it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplan.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted for recompute)
    RUNNING = "running"  # holding blocks; prefilling or decoding
    FINISHED = "finished"


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
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    # with params.logprobs: one entry per output token; with params.prompt_logprobs: one
    # per prompt token after the first (`kvplan.engine.logprobs.TokenLogprob`)
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
