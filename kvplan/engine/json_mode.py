"""JSON mode: constrain sampling so that a completion is one JSON object (OpenAI's
``response_format={"type": "json_object"}``).

Three pieces:

* ``step(state, byte)``: a byte-level recognizer of JSON text (RFC 8259 values; the top level
  an object, no leading whitespace, at most `MAX_WS` whitespace bytes in a row) as an
  immutable state; ``None`` rejects the byte. States
  are small tuples ``(mode, stack, extra)``; ``stack`` holds the open containers' bytes
  (``{`` / ``[``). Strings take well-formed UTF-8 only (what Python's decoder accepts).
* ``TokenTrie``: the vocabulary's byte strings in a trie whose nodes know their subtree's
  token range (tokens numbered in trie order) and whether every byte below them is plain
  string content (printable ASCII but quote and backslash). ``allowed(state)`` walks the trie
  with the recognizer, pruning at the first rejected byte; inside a string a plain subtree is
  taken whole without walking it, and the tokens that stay in the string are one mask per
  UTF-8 state whatever the containers around it (only the tokens holding a quote or a
  backslash are walked per state). Masks are memoized per state.
* ``JsonGuide``: one request's position: it feeds the request's sampled tokens and gives the
  boolean mask of the tokens that keep the text a JSON prefix; once the object is complete
  only the end-of-sequence tokens remain (so a guided completion stops right after it).

``token_bytes(tokenizer)`` recovers each token's bytes from a Hugging Face tokenizer:
byte-level BPE pieces (GPT-2's byte-to-character table, e.g. SmolLM2) or SentencePiece pieces
(``▁`` for a space, ``<0xHH>`` byte tokens, e.g. Gemma); special tokens have none.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

__all__ = [
    "JSON_OBJECT",
    "NOT_STRING",
    "JsonGuide",
    "TokenTrie",
    "complete",
    "start_state",
    "step",
    "string_of",
    "token_bytes",
]

_WS = frozenset(b" \t\n\r")
MAX_WS = 16  # whitespace bytes in a row between tokens (a weak model cannot loop on them)
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# number modes that may end the number (the next byte then belongs to what follows it)
_NUMBER_END = frozenset({"n0", "ni", "nf", "nx"})

State = tuple


def _utf8_leads() -> dict[int, tuple[int, int, int]]:
    """Lead byte -> (continuation bytes, range of the first one): well-formed UTF-8 only (no
    overlong forms, surrogates or code points past U+10FFFF)."""
    leads = {b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}
    leads.update({b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0)})
    leads[0xE0], leads[0xED] = (2, 0xA0, 0xBF), (2, 0x80, 0x9F)
    leads.update({b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)})
    leads[0xF0], leads[0xF4] = (3, 0x90, 0xBF), (3, 0x80, 0x8F)
    return leads


_UTF8_LEADS = _utf8_leads()


def start_state() -> State:
    """Before the first byte: only ``{`` may come."""
    return ("top", (), None)


def complete(state: State) -> bool:
    """Whether the text so far is one whole JSON object."""
    return state[0] == "end"


def _after_value(stack: tuple) -> State:
    return ("end", (), None) if not stack else ("next", stack, None)


def _value_start(b: int, stack: tuple) -> State | None:
    """The state after the first byte ``b`` of a value inside ``stack``."""
    if b == 0x7B:  # {
        return ("key0", stack + (0x7B,), None)
    if b == 0x5B:  # [
        return ("arr0", stack + (0x5B,), None)
    if b == 0x22:  # "
        return ("str", stack, False)
    if b == 0x2D:  # -
        return ("n-", stack, None)
    if b == 0x30:  # 0
        return ("n0", stack, None)
    if b in _DIGITS:
        return ("ni", stack, None)
    rest = _LITERALS.get(b)
    if rest is not None:
        return ("lit", stack, rest)
    return None


def _number(mode: str, b: int) -> str | None:
    """The number mode after ``b``, or None where ``b`` does not continue the number."""
    digit = b in _DIGITS
    if mode == "n-":
        return "n0" if b == 0x30 else "ni" if digit else None
    if mode in ("n0", "ni"):
        if mode == "ni" and digit:
            return "ni"
        return "nd" if b == 0x2E else "ne" if b in (0x65, 0x45) else None
    if mode == "nd":
        return "nf" if digit else None
    if mode == "nf":
        return "nf" if digit else "ne" if b in (0x65, 0x45) else None
    if mode == "ne":
        return "ns" if b in (0x2B, 0x2D) else "nx" if digit else None
    if mode in ("ns", "nx"):
        return "nx" if digit else None
    raise AssertionError(mode)


def step(state: State, b: int) -> State | None:
    """The recognizer's state after byte ``b`` (0-255), or None if ``b`` cannot follow."""
    mode, stack, extra = state
    if mode == "str":
        if b == 0x22:
            return ("colon", stack, None) if extra else _after_value(stack)
        if b == 0x5C:
            return ("esc", stack, extra)
        if b < 0x80:
            return None if b < 0x20 else state
        lead = _UTF8_LEADS.get(b)  # a multi-byte character: its continuation bytes next
        return None if lead is None else ("utf", stack, (extra, *lead))
    if mode == "utf":
        is_key, left, lo, hi = extra
        if not lo <= b <= hi:
            return None
        return (
            ("str", stack, is_key) if left == 1 else ("utf", stack, (is_key, left - 1, 0x80, 0xBF))
        )
    if mode == "esc":
        if b == 0x75:  # u
            return ("hex", stack, (extra, 4))
        return ("str", stack, extra) if b in _ESCAPES else None
    if mode == "hex":
        is_key, left = extra
        if b not in _HEX:
            return None
        return ("str", stack, is_key) if left == 1 else ("hex", stack, (is_key, left - 1))
    if mode == "lit":
        if b != extra[0]:
            return None
        return _after_value(stack) if len(extra) == 1 else ("lit", stack, extra[1:])
    if mode[0] == "n" and mode != "next":
        nxt = _number(mode, b)
        if nxt is not None:
            return (nxt, stack, None)
        if mode not in _NUMBER_END:
            return None
        return step(_after_value(stack), b)  # the number ended before b
    if b in _WS:  # between tokens: at most MAX_WS in a row (``extra`` counts them)
        if mode in ("top", "end") or (extra or 0) >= MAX_WS:
            return None
        return (mode, stack, (extra or 0) + 1)
    if mode == "top":
        return ("key0", (0x7B,), None) if b == 0x7B else None
    if mode == "end":
        return None
    if mode in ("key0", "key"):
        if b == 0x22:
            return ("str", stack, True)
        if mode == "key0" and b == 0x7D:  # } of an empty object
            return _after_value(stack[:-1])
        return None
    if mode == "colon":
        return ("value", stack, None) if b == 0x3A else None
    if mode in ("value", "arr0"):
        if mode == "arr0" and b == 0x5D:  # ] of an empty array
            return _after_value(stack[:-1])
        return _value_start(b, stack)
    if mode == "next":
        top = stack[-1]
        if b == 0x2C:  # ,
            return ("key", stack, None) if top == 0x7B else ("value", stack, None)
        if (b == 0x7D and top == 0x7B) or (b == 0x5D and top == 0x5B):
            return _after_value(stack[:-1])
        return None
    raise AssertionError(mode)


def _plain(b: int) -> bool:
    """A byte that leaves a string's state as it is (printable ASCII but quote and
    backslash)."""
    return 0x20 <= b < 0x80 and b != 0x22 and b != 0x5C


class _Trie:
    """Byte strings of some tokens as a flat trie: node ``k``'s children ``[(byte, node)]``,
    the tokens ending there, its subtree's token span in ``order`` and whether every byte
    below it is plain string content (`_plain`)."""

    def __init__(self, pieces: Sequence[bytes | None], keep=None) -> None:
        root: dict = {}
        for tid, piece in enumerate(pieces):
            if not piece or (keep is not None and not keep(piece)):
                continue
            node = root
            for b in piece:
                node = node.setdefault(b, {})
            node.setdefault(None, []).append(tid)  # tokens ending at this node
        order: list[int] = []
        self.children: list[list[tuple[int, int]]] = []
        self.ends: list[list[int]] = []
        self.span: list[tuple[int, int]] = []
        self.plain: list[bool] = []

        def build(tree: dict) -> bool:  # recursion depth: the longest piece (tens of bytes)
            k = len(self.children)
            self.children.append([])
            self.ends.append(tree.get(None, []))
            self.span.append((0, 0))
            self.plain.append(True)
            first = len(order)
            order.extend(self.ends[k])
            plain = True
            for b in sorted(x for x in tree if x is not None):
                child = len(self.children)
                child_plain = build(tree[b])
                self.children[k].append((b, child))
                plain = plain and child_plain and _plain(b)
            self.span[k] = (first, len(order))
            self.plain[k] = plain
            return plain

        build(root)
        self.order = np.asarray(order, dtype=np.int64)

    def walk(self, state: State, out: np.ndarray, follow=None, machine=None) -> None:
        """Mark in ``out`` the tokens whose bytes all follow ``state`` (``follow``: only
        bytes it admits) under the recognizer ``machine`` (default `JSON_OBJECT`); inside a
        string a plain subtree is taken whole."""
        step_fn = (machine or JSON_OBJECT).step
        string_fn = (machine or JSON_OBJECT).string_of
        todo = [(0, state)]
        while todo:
            k, st = todo.pop()
            if k and self.plain[k] and string_fn(st) is None:
                lo, hi = self.span[k]
                out[self.order[lo:hi]] = True  # plain content: the whole subtree
                continue
            if self.ends[k]:
                out[self.ends[k]] = True
            for b, child in self.children[k]:
                if follow is not None and not follow(b):
                    continue
                nxt = step_fn(st, b)
                if nxt is not None:
                    todo.append((child, nxt))


NOT_STRING = "not a string"  # `string_of` outside a string


def string_of(state: State):
    """Inside a string: None (no character in progress) or the UTF-8 character in progress
    (the ``utf`` state's tail); elsewhere (escapes included) `NOT_STRING`."""
    if state[0] == "str":
        return None
    if state[0] == "utf":
        return state[2][1:]
    return NOT_STRING


JSON_OBJECT = SimpleNamespace(start_state=start_state, step=step, complete=complete,
                              string_of=string_of)  # fmt: skip
"""JSON mode's recognizer as one object: the interface a `TokenTrie` and a `JsonGuide` read
(`kvplan.engine.json_schema.JsonSchema` has it too)."""


def _inside(b: int) -> bool:
    """A byte that may stand inside a string without ending or escaping it."""
    return b >= 0x20 and b != 0x22 and b != 0x5C


class TokenTrie:
    """The vocabulary's byte strings as a trie (module docstring). ``pieces[i]``: token
    ``i``'s bytes, None for tokens never allowed (special tokens, unused ids).

    Inside a string (no escape pending) the allowed set splits in two: tokens that stay in
    the string, which depend only on the UTF-8 character in progress (one mask per such
    state, whatever the containers around the string), and tokens holding a quote or a
    backslash, walked in a trie of those tokens alone. Other states walk the whole trie."""

    MEMO_BYTES = 1 << 28  # the memo's masks (one byte a token each) kept per trie ...
    VIEW_MEMO_BYTES = 1 << 26  # ... and per `view` (a schema's)

    def __init__(self, pieces: Sequence[bytes | None]) -> None:
        self.vocab_size = len(pieces)
        self.full = _Trie(pieces)
        self.special = _Trie(pieces, keep=lambda p: 0x22 in p or 0x5C in p)
        self.machine = JSON_OBJECT
        self._memo: dict[State, np.ndarray] = {}
        self._memo_max = max(64, self.MEMO_BYTES // max(1, self.vocab_size))
        self._inner: dict[tuple, np.ndarray] = {}

    def view(self, machine) -> TokenTrie:
        """The same vocabulary under another recognizer whose strings read as JSON's
        (``machine``: ``start_state`` / ``step`` / ``complete`` / ``string_of``, e.g. a
        `JsonSchema`), sharing the tries and the in-string masks, with masks memoized per
        view."""
        other = object.__new__(TokenTrie)
        other.vocab_size, other.full, other.special = self.vocab_size, self.full, self.special
        other.machine = machine
        other._memo, other._inner = {}, self._inner
        other._memo_max = max(64, self.VIEW_MEMO_BYTES // max(1, self.vocab_size))
        return other

    def allowed(self, state: State) -> np.ndarray:
        """bool ``[vocab_size]``: the tokens whose bytes all follow ``state``."""
        hit = self._memo.get(state)
        if hit is not None:
            return hit
        utf = self.machine.string_of(state)
        if utf is not NOT_STRING:
            inner = self._inner.get(utf)
            if inner is None:  # staying in the string: the containers do not matter
                inner = np.zeros(self.vocab_size, dtype=bool)
                start = ("str", (), False) if utf is None else ("utf", (), (False, *utf))
                self.full.walk(start, inner, follow=_inside)
                self._inner[utf] = inner
            out = inner.copy()
            self.special.walk(state, out, machine=self.machine)
        else:
            out = np.zeros(self.vocab_size, dtype=bool)
            self.full.walk(state, out, machine=self.machine)
        out.flags.writeable = False  # memoized: callers share it
        if len(self._memo) >= self._memo_max:
            self._memo.clear()
        self._memo[state] = out
        return out


class JsonGuide:
    """One request's JSON mode: ``feed`` its sampled tokens, ``mask`` the next step's allowed
    tokens (``vocab`` wide: ids past the trie's vocabulary are never allowed)."""

    def __init__(self, trie: TokenTrie, pieces: Sequence[bytes | None], eos_ids: Sequence[int]):
        """The text is one value of ``trie.machine``'s language: any JSON object, or an
        instance of a `kvplan.engine.json_schema.JsonSchema` (``trie`` its view)."""
        self.trie, self.pieces = trie, pieces
        self.machine = trie.machine
        self.eos = sorted(set(eos_ids))
        self.state = self.machine.start_state()
        self.fed = 0  # output tokens fed so far

    def feed(self, token_ids: Sequence[int]) -> None:
        """Advance over the output tokens not fed yet (``token_ids``: the whole output)."""
        for tid in token_ids[self.fed :]:
            piece = self.pieces[tid] if tid < len(self.pieces) else None
            if piece is None or self.machine.complete(self.state):
                raise ValueError(f"token {tid} does not continue the JSON text")
            for b in piece:
                nxt = self.machine.step(self.state, b)
                if nxt is None:
                    raise ValueError(f"token {tid} ({piece!r}) does not continue the JSON text")
                self.state = nxt
        self.fed = len(token_ids)

    def mask(self, vocab: int) -> np.ndarray:
        """bool ``[vocab]`` (read-only): the allowed next tokens; only EOS once the object is
        complete, or where no token of the vocabulary continues the text (the request
        ends)."""
        allowed = None if self.machine.complete(self.state) else self.trie.allowed(self.state)
        if allowed is not None and allowed.shape[0] == vocab and allowed.any():
            return allowed  # the trie's memo: read-only, so shared safely
        out = np.zeros(vocab, dtype=bool)
        if allowed is not None and allowed.any():
            n = min(vocab, allowed.shape[0])
            out[:n] = allowed[:n]
        else:
            out[[t for t in self.eos if t < vocab]] = True
        return out


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's character for each byte, inverted: printable Latin-1 bytes
    stand for themselves, the others (controls, space, ...) for ``chr(256 + k)`` in byte
    order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer) -> list[bytes | None]:
    """Every token id's bytes (module docstring); None for special tokens and pieces that
    cannot be mapped."""
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    # how the tokenizer spells " a b\n": byte-level BPE as "Ġa", "Ġb", "Ċ"; SentencePiece "▁a"
    probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a b\n", add_special_tokens=False))
    byte_level = not any("\u2581" in p for p in probe if p) and any(
        "\u0120" in p or "\u010a" in p for p in probe if p
    )
    table = _byte_level_table() if byte_level else None
    out: list[bytes | None] = []
    for tid, p in enumerate(pieces):
        if tid in special or not p:
            out.append(None)
        elif table is not None:
            try:
                out.append(bytes(table[c] for c in p))
            except KeyError:  # an added token outside the byte alphabet: its text
                out.append(p.encode("utf-8"))
        elif len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            out.append(bytes([int(p[3:5], 16)]))
        else:
            out.append(p.replace("\u2581", " ").encode("utf-8"))
    return out
