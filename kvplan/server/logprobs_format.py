"""Engine logprobs (`kvplan.engine.logprobs.TokenLogprob`) in the OpenAI response shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
(parallel lists; an echoed prompt's first token has logprob and top list ``None``). A token's
text is its own decoding (special tokens included); ``text_offset`` adds those lengths up, so
it indexes the text exactly when per-token decodings concatenate to the full decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplan.engine.logprobs import TokenLogprob


def token_text(tok: Any, token_id: int) -> str:
    """One token's text (``token_id:<id>`` without a tokenizer)."""
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)


def _item(tok: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: Any, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``choices[i].logprobs`` object of ``entries`` (one per generated token)."""
    content = []
    for e in entries:
        item = _item(tok, e.token_id, e.logprob)
        item["top_logprobs"] = [_item(tok, t, lp) for t, lp in e.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    tok: Any,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """(the completions ``choices[i].logprobs`` object of ``token_ids`` with their
    ``entries`` (None: no logprob, e.g. the first prompt token), the text offset after them);
    ``offset``: the text offset of the first token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, e in zip(token_ids, entries, strict=True):
        text = token_text(tok, t)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(e.logprob)
            tops.append({token_text(tok, a): lp for a, lp in e.top})
    obj = {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return obj, offset
