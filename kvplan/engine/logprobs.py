"""Log-probabilities of sampled and prompt tokens, computed from a step's fp32 logits.

The logprobs are those of the model's distribution, ``log_softmax(logits)`` of the raw
logits: with ``temperature`` / ``top_k`` / ``top_p`` the token is drawn from the adjusted
distribution, but its reported logprob (and the top-k list) is the unadjusted one, the
OpenAI-compatible default.

One ``log_softmax`` and one ``topk`` per step cover every logits row that asks (sampled
rows of requests with ``SamplingParams.logprobs``, prompt rows of requests with
``prompt_logprobs``); steps in which no row asks compute nothing. The device results are
copied to the host when the step's tokens are processed (`PendingLogprobs.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvplan.engine.runner import StepInputs
    from kvplan.engine.step import StepBatch

MAX_LOGPROBS = 20  # most top-k alternatives a request may ask for


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's logprob and the top-k of its step: ``top[i] = (token_id, logprob)``, most
    likely first (``len(top) == k``; the token itself need not be among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class PendingLogprobs:
    """Device results of one step, not yet on the host.

    ``sample_rows[i]`` is the logits row of the i-th sampled entry; ``prompt_seqs[j]`` the
    scheduled row index (in ``step.seqs``) that owns prompt group j with ``prompt_counts[j]``
    entries; entries are ordered sampled first, then prompt groups; ``ks[e]`` is entry e's k.
    """

    sample_rows: list[int]
    prompt_seqs: list[int]
    prompt_counts: list[int]
    ks: list[int]
    targets: torch.Tensor  # int64 [M]
    chosen: torch.Tensor  # fp32 [M]
    top_ids: torch.Tensor | None  # int64 [M, kmax]
    top_lps: torch.Tensor | None  # fp32 [M, kmax]

    def resolve(self) -> tuple[dict[int, TokenLogprob], dict[int, list[TokenLogprob]]]:
        """(logits row -> entry of its sampled token, seq index -> its prompt entries)."""
        targets = self.targets.tolist()
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        lps = self.top_lps.tolist() if self.top_lps is not None else None
        entries = []
        for e, (t, c, k) in enumerate(zip(targets, chosen, self.ks)):
            top = tuple(zip(ids[e][:k], lps[e][:k])) if k else ()
            entries.append(TokenLogprob(t, c, top))
        n = len(self.sample_rows)
        by_row = dict(zip(self.sample_rows, entries[:n]))
        prompt: dict[int, list[TokenLogprob]] = {}
        pos = n
        for seq, count in zip(self.prompt_seqs, self.prompt_counts):
            prompt[seq] = entries[pos : pos + count]
            pos += count
        return by_row, prompt


def compute_logprobs(
    logits: torch.Tensor,
    rows: list[int],
    targets: torch.Tensor,
    ks: list[int],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprob of ``targets[i]`` under row ``rows[i]`` of ``logits [N, V]`` (fp32) and that
    row's top-``max(ks)``: (chosen fp32 ``[M]``, top ids int64 ``[M, kmax]``, top logprobs
    fp32 ``[M, kmax]``; None when ``max(ks) == 0``), all on the logits device."""
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    lp = logits.index_select(0, idx).float().log_softmax(dim=-1)  # [M, V]
    chosen = lp.gather(1, targets[:, None]).squeeze(1)
    kmax = max(ks, default=0)
    if kmax == 0:
        return chosen, None, None
    top_lps, top_ids = lp.topk(min(kmax, lp.shape[1]), dim=-1)
    return chosen, top_ids, top_lps


def queue_logprobs(
    step: StepBatch, inputs: StepInputs, logits: torch.Tensor, tokens: torch.Tensor | None
) -> PendingLogprobs | None:
    """Queue on the device the logprobs a step owes: each sampled token of a request with
    ``logprobs`` (``tokens [num_sample_rows]`` int64, its logits rows), each prompt token of
    ``inputs.prompt_rows``; None when there are none. ``logits`` holds every row of
    ``inputs.logits_rows``."""
    sample_rows: list[int] = []
    ks: list[int] = []
    for s, sl in zip(step.seqs, inputs.row_slices):
        k = s.request.params.logprobs
        if k is not None and sl.stop > sl.start:
            sample_rows.extend(range(sl.start, sl.stop))
            ks.extend([k] * (sl.stop - sl.start))
    if not sample_rows and not inputs.prompt_rows:
        return None
    rows = list(sample_rows)
    prompt_targets: list[int] = []
    row = inputs.num_sample_rows
    for i, first, count in inputs.prompt_rows:
        req = step.seqs[i].request
        prompt_targets.extend(req.prompt_token_ids[first : first + count])
        rows.extend(range(row, row + count))
        ks.extend([req.params.prompt_logprobs] * count)
        row += count
    dev = logits.device
    parts = []
    if sample_rows:
        parts.append(tokens[torch.tensor(sample_rows, dtype=torch.int64, device=dev)])
    if prompt_targets:
        parts.append(torch.tensor(prompt_targets, dtype=torch.int64, device=dev))
    targets = torch.cat(parts) if len(parts) > 1 else parts[0]
    chosen, top_ids, top_lps = compute_logprobs(logits, rows, targets, ks)
    return PendingLogprobs(
        sample_rows,
        [p[0] for p in inputs.prompt_rows],
        [p[2] for p in inputs.prompt_rows],
        ks,
        targets,
        chosen,
        top_ids,
        top_lps,
    )
