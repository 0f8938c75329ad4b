"""Speculative decoding with prompt-lookup (n-gram) drafts, verified in one step.

Proposal: find the most recent earlier occurrence of the sequence's last ``n`` tokens
(``n = max_ngram .. min_ngram``, longest first) and propose the ``num_draft_tokens`` tokens
that followed it.

Verification: the decode row feeds ``[last token, d1, .., dk]`` (positions ``L .. L+k``; the
manager's *logical* length covers only position ``L``, the drafts sit in *reserved* blocks).
The model's greedy tokens ``g0 .. gk`` at those rows are compared with the drafts: draft
``d(i+1)`` is accepted while ``d(i+1) == g(i)`` for every earlier i. With ``a`` drafts accepted,
the new tokens are ``g0 .. ga`` -- exactly what plain greedy decoding would emit, since every
accepted draft equals the greedy token at its position and each ``g(i)`` saw only accepted
history. The logical length then grows by ``a`` (``extend``); rejected drafts' slots stay
reserved and are overwritten later.

Example: tokens ``... 5 6 7 | 8 9 ... 5 6 7`` with n=3, k=2 propose ``[8, 9]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Up to ``num_draft_tokens`` drafts continuing ``tokens`` (empty when no match)."""
        tokens = list(tokens)
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tok - n :]
            # most recent earlier match; the match must end before the tail starts
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + self.num_draft_tokens]
                    if follow:
                        return follow
        return []


def accept_drafts(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """New tokens after verifying ``drafts`` (k) against ``greedy`` (k + 1 model tokens).

    Returns ``greedy[: a + 1]`` where ``a`` is the number of leading drafts that match.

    >>> accept_drafts([4, 5, 6], [4, 5, 9, 1])
    [4, 5, 9]
    """
    if len(greedy) != len(drafts) + 1:
        raise ValueError(f"need len(greedy) == len(drafts) + 1, got {len(greedy)}, {len(drafts)}")
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return list(greedy[: a + 1])
