"""Structured output: constrain sampling so that a completion is one JSON value that a JSON
schema accepts (OpenAI's ``response_format={"type": "json_schema", "json_schema": {"schema":
...}}``).

`JsonSchema(schema)` compiles a schema into a table of nodes and is a byte-level recognizer
like `kvplan.engine.json_mode`'s, whose states are tuples of frames (outermost first):

* ``("v", node, ws)``: a value of ``node`` comes next (after at most ``ws`` more whitespace
  bytes);
* ``("d", node, js)``: inside a string, number or literal (or any value, for ``node`` of
  kind any), run by `json_mode.step` on its own state ``js``;
* ``("e", node, pos, candidates)``: ``pos`` bytes into the JSON texts of an ``enum``;
* ``("o", node, phase, seen, key, ws)``: an object: ``phase`` "k0" after ``{``, "k" after ``,``,
  "key" inside a key (``key``: its bytes so far), "colon" (``key``: the property's index),
  "after" after a member's value; ``seen``: a bit mask of the properties written;
* ``("a", node, phase, ws, count)``: an array, ``phase`` "a0" after ``[`` or "after" after
  an item; ``count``: the items so far (for ``minItems`` / ``maxItems``).

``ws`` in object and array frames counts the whitespace bytes in a row: as in JSON mode, at
most `json_mode.MAX_WS` between tokens.

The empty tuple is the finished value. A number ends at the first byte that cannot continue
it, which then goes to the frame below. `json_mode.TokenTrie.view` turns the recognizer into
token masks, with the same shortcut inside strings.

The schema subset (other keywords are refused, naming their path): ``type`` (one of object,
array, string, number, integer, boolean, null, or a list of them; implied by ``properties`` /
``required`` / ``additionalProperties`` or ``items`` where left out), ``properties``,
``required``, ``additionalProperties`` (only false: an object holds its listed properties, in
any order, each at most once, the required ones before it closes), ``items``,
``minItems`` / ``maxItems``, ``enum``, ``const``, ``anyOf`` (any branches: those that can
start with a byte are read side by side in an ``("x", stacks)`` frame, each stack on a
``_Z`` bottom that stands for its value's end), ``$defs`` / ``definitions`` with ``$ref`` to them
(recursive schemas included), and the annotations ``title``, ``description``, ``default``,
``examples``, ``$schema``, ``$id``, ``strict``. An object without ``properties`` (or ``{}`` as
a schema) is any JSON value of that type. The root must be an object or an array.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvplan.engine import json_mode
from kvplan.engine.json_mode import MAX_WS

__all__ = ["TOOL_CALL_MIDDLE", "TOOL_CALL_PREFIX", "JsonSchema"]

_WS = frozenset(b" \t\n\r")
_NUMBER_START = frozenset(b"-0123456789")
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "strict", "$comment"}
)
_DEFS = frozenset({"$defs", "definitions"})  # read by `_compile_document`, not a keyword here
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# the first bytes of each kind's JSON text
_FIRST = {
    "object": frozenset(b"{"),
    "array": frozenset(b"["),
    "string": frozenset(b'"'),
    "number": _NUMBER_START,
    "integer": _NUMBER_START,
    "boolean": frozenset(b"tf"),
    "null": frozenset(b"n"),
}
_VALUE = ("value", (), None)  # json_mode's state before a value's first byte
_Z = ("z",)  # the bottom of an alternative's stack: its value is whole
_END = "ended"  # `JsonSchema.step` on a stack whose value ended before the byte
# a tool call's text: TOOL_CALL_PREFIX, the quoted name, TOOL_CALL_MIDDLE, the arguments, }
TOOL_CALL_PREFIX = b'{"name": '
TOOL_CALL_MIDDLE = b', "arguments": '


def _schema_dict(schema: Mapping[str, Any] | str, where: str) -> Mapping[str, Any]:
    """A schema given as a dict or its JSON text, as a dict (ValueError naming ``where``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(schema).__name__}")
    return schema


class JsonSchema:
    """A compiled JSON schema (module docstring); ``schema`` a dict (or its JSON text).
    ValueError names the path of an unsupported or malformed part (``where`` prefixes it)."""

    def __init__(self, schema: Mapping[str, Any] | str, where: str = "json_schema") -> None:
        schema = _schema_dict(schema, where)
        self.text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        self.nodes: list[tuple] = []
        self.root = self._compile_document(schema, where)
        if self.nodes[self.root][0] not in ("object", "array", "any_object", "any_array"):
            raise ValueError(f"{where}: the root must be an object or an array schema")

    @classmethod
    def tool_call(
        cls, tools: Sequence[tuple[str, Mapping[str, Any]]], where: str = "tools"
    ) -> JsonSchema:
        """The recognizer of one call of one of ``tools`` (``(name, parameters schema)``),
        written exactly as ``{"name": "NAME", "arguments": ARGS}`` (`TOOL_CALL_PREFIX` ...)
        with ARGS an instance of that tool's parameters (any spacing inside ARGS)."""
        self = object.__new__(cls)
        self.text = json.dumps([[n, p] for n, p in tools], sort_keys=True, separators=(",", ":"))
        self.nodes = []
        names, args = [], []
        for i, (name, params) in enumerate(tools):
            sub = f"{where}[{i}].function.parameters"
            args.append(self._compile_document(_schema_dict(params, sub), sub))
            names.append(json.dumps(name, ensure_ascii=False).encode())
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: function names must be distinct")
        self.root = self._add(("call", tuple(names), tuple(args)))
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonSchema) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"JsonSchema({self.text})"

    # -- compiling --------------------------------------------------------------------------

    def _compile_document(self, schema: Mapping[str, Any], where: str) -> int:
        """Compile a whole schema document (its ``$defs`` / ``definitions`` and ``#`` in
        scope for its ``$ref``s)."""
        self._root_doc = schema
        self._defs = {}
        for key in sorted(_DEFS):
            defs = schema.get(key, {})
            if not isinstance(defs, Mapping):
                raise ValueError(f"{where}.{key} must be an object")
            for name, sub in defs.items():
                self._defs[f"#/{key}/{name}"] = sub
        self._refs: dict[str, int] = {}
        return self._compile(schema, where)

    def _add(self, node: tuple) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, s: Any, where: str) -> int:
        if s is True or (isinstance(s, Mapping) and not set(s) - _ANNOTATIONS - _DEFS):
            return self._add(("any",))
        if not isinstance(s, Mapping):
            raise ValueError(f"{where} must be a schema object, got {s!r}")
        if "$ref" in s:
            return self._ref(s, where)
        if "enum" in s or "const" in s:
            return self._enum(s, where)
        if "anyOf" in s:
            return self._any_of(s, where)
        kind = s.get("type")
        if kind is None:  # implied by the keywords
            if {"properties", "required", "additionalProperties"} & set(s):
                kind = "object"
            elif "items" in s:
                kind = "array"
            else:
                extra = sorted(set(s) - _ANNOTATIONS - _DEFS)
                raise ValueError(f"{where}: keyword {extra[0]!r} is not supported")
            s = {**s, "type": kind}
        if isinstance(kind, list):
            return self._alt([{**s, "type": k} for k in kind], f"{where}.type", where)
        if kind not in _TYPES:
            raise ValueError(f"{where}.type={kind!r} is not supported (one of {list(_TYPES)})")
        allowed = {
            "object": {"type", "properties", "required", "additionalProperties"},
            "array": {"type", "items", "minItems", "maxItems"},
        }.get(kind, {"type"})
        extra = sorted(set(s) - allowed - _ANNOTATIONS - _DEFS)
        if extra:
            raise ValueError(f"{where}: keyword {extra[0]!r} is not supported")
        if kind == "object":
            return self._object(s, where)
        if kind == "array":
            lo, hi = s.get("minItems", 0), s.get("maxItems")
            for key, v in (("minItems", lo), ("maxItems", hi)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"{where}.{key}={v!r} must be an int >= 0")
            if hi is not None and hi < lo:
                raise ValueError(f"{where}: maxItems={hi} is below minItems={lo}")
            if "items" not in s and not lo and hi is None:
                return self._add(("any_array",))
            idx = self._add(("array", -1, lo, hi))
            item = self._compile(s.get("items", True), f"{where}.items")
            self.nodes[idx] = ("array", item, lo, hi)
            return idx
        return self._add((kind,))

    def _ref(self, s: Mapping, where: str) -> int:
        ref = s["$ref"]
        if set(s) - {"$ref"} - _ANNOTATIONS:
            raise ValueError(f"{where}: $ref takes no sibling keywords")
        if ref == "#":
            target = self._root_doc
        elif ref in self._defs:
            target = self._defs[ref]
        else:
            raise ValueError(f"{where}.$ref={ref!r}: only '#' and '#/$defs/NAME' are supported")
        if ref not in self._refs:  # a placeholder first, so recursive references resolve
            self._refs[ref] = self._add(("ref", -1))
            self.nodes[self._refs[ref]] = ("ref", self._compile(target, f"{where}<{ref}>"))
        return self._refs[ref]

    def _enum(self, s: Mapping, where: str) -> int:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}.enum must be a non-empty list")
        texts = []
        for v in values:
            if isinstance(v, (dict, list)):
                raise ValueError(f"{where}.enum: objects and arrays are not supported, got {v!r}")
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                raise ValueError(f"{where}.enum: {v!r} is not JSON")
            texts.append(json.dumps(v, ensure_ascii=False).encode())
        return self._add(("enum", tuple(dict.fromkeys(texts))))

    def _object(self, s: Mapping, where: str) -> int:
        props = s.get("properties")
        if props is None:
            return self._add(("any_object",))
        if not isinstance(props, Mapping):
            raise ValueError(f"{where}.properties must be an object")
        if s.get("additionalProperties", False) is not False:
            raise ValueError(f"{where}.additionalProperties must be false (or absent)")
        names = list(props)
        for name in names:
            raw = name.encode()
            if any(b < 0x20 or b in (0x22, 0x5C) for b in raw):
                raise ValueError(f"{where}.properties: name {name!r} needs escaping")
        required = s.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ValueError(f"{where}.required must list names of properties, got {required!r}")
        idx = self._add(("object", (), (), 0))
        children = tuple(self._compile(props[n], f"{where}.properties.{n}") for n in names)
        mask = sum(1 << names.index(r) for r in set(required))
        self.nodes[idx] = ("object", tuple(n.encode() for n in names), children, mask)
        return idx

    def _any_of(self, s: Mapping, where: str) -> int:
        branches = s["anyOf"]
        if set(s) - {"anyOf"} - _ANNOTATIONS:
            raise ValueError(f"{where}: anyOf takes no sibling keywords")
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"{where}.anyOf must be a non-empty list")
        return self._alt(branches, f"{where}.anyOf", where)

    def _alt(self, branches: list, label: str, where: str) -> int:
        idx = [self._compile(b, f"{label}[{i}]") for i, b in enumerate(branches)]
        return self._add(("alt", tuple(idx)))

    # -- recognizing ------------------------------------------------------------------------

    def start_state(self) -> tuple:
        """Before the first byte (no leading whitespace)."""
        if self.nodes[self.root][0] == "call":
            return (("c", self.root, "open", 0, None),)
        return (("v", self.root, 0),)

    @classmethod
    def complete(cls, state: tuple) -> bool:
        """Whether the text so far is a whole value (``state`` a state, or an alternative's
        stack, whose ``_Z`` bottom stands for the value's end)."""
        if state[:1] == (_Z,):
            state = state[1:]
        if not state:
            return True
        return len(state) == 1 and state[0][0] == "x" and any(map(cls.complete, state[0][1]))

    def step(self, state: tuple, b: int):
        """The state after byte ``b``, or None if ``b`` cannot follow (`_END` on an
        alternative's stack whose value ended before ``b``)."""
        if not state:
            return None
        frame = state[-1]
        kind = frame[0]
        rest = state[:-1]
        if kind == "z":
            return _END
        if kind == "x":
            return self._alternatives_step(rest, frame[1], b)
        if kind == "v":
            if b in _WS:
                return rest + (("v", frame[1], frame[2] - 1),) if frame[2] else None
            return self._start(rest, frame[1], b)
        if kind == "d":
            return self._delegated(rest, frame, b)
        if kind == "e":
            _, node, pos, cands = frame
            nxt = tuple(c for c in cands if len(c) > pos and c[pos] == b)
            if nxt:
                return rest + (("e", node, pos + 1, nxt),)
            if any(len(c) == pos for c in cands):  # the value ended before b
                return self.step(rest, b)
            return None
        if kind == "o":
            return self._object_step(rest, frame, b)
        if kind == "c":
            return self._call_step(rest, frame, b)
        return self._array_step(rest, frame, b)

    def _call_step(self, rest: tuple, frame: tuple, b: int) -> tuple | None:
        """``("c", node, phase, pos, extra)``: the fixed text of a tool call around its name
        (``extra``: the names still possible) and its arguments (``extra``: the tool)."""
        _, node, phase, pos, extra = frame
        _, names, args = self.nodes[node]
        if phase == "name":
            nxt = tuple(i for i in extra if len(names[i]) > pos and names[i][pos] == b)
            if not nxt:
                return None
            if len(nxt) == 1 and len(names[nxt[0]]) == pos + 1:  # the closing quote
                return rest + (("c", node, "mid", 0, nxt[0]),)
            return rest + (("c", node, "name", pos + 1, nxt),)
        lit = {"open": TOOL_CALL_PREFIX, "mid": TOOL_CALL_MIDDLE, "close": b"}"}[phase]
        if lit[pos] != b:
            return None
        if pos + 1 < len(lit):
            return rest + (("c", node, phase, pos + 1, extra),)
        if phase == "open":
            return rest + (("c", node, "name", 0, tuple(range(len(names)))),)
        if phase == "mid":
            return rest + (("c", node, "close", 0, None), ("v", args[extra], 0))
        return rest

    def _start(self, rest: tuple, node: int, b: int) -> tuple | None:
        """The state after ``b``, the first byte of a value of ``node`` (below it: ``rest``)."""
        n = self.nodes[node]
        kind = n[0]
        if kind == "ref":
            return self._start(rest, n[1], b)
        if kind == "alt":  # every branch that can start with b, read side by side
            subs = [self._start((_Z,), branch, b) for branch in n[1]]
            return self._alternatives(rest, [x for x in subs if x is not None])
        if kind == "enum":
            cands = tuple(t for t in n[1] if t[0] == b)
            return rest + (("e", node, 1, cands),) if cands else None
        if kind == "object":
            return rest + (("o", node, "k0", 0, None, 0),) if b == 0x7B else None
        if kind == "array":
            return rest + (("a", node, "a0", 0, 0),) if b == 0x5B else None
        if (
            kind != "any"
            and b not in _FIRST[{"any_object": "object", "any_array": "array"}.get(kind, kind)]
        ):
            return None
        js = json_mode.step(_VALUE, b)
        return None if js is None else rest + (("d", node, js),)

    @staticmethod
    def _alternatives(rest: tuple, subs: list) -> tuple | None:
        """``rest`` under the live alternatives ``subs`` (stacks on ``_Z``): one is put in
        place, several go in an ``("x", subs)`` frame."""
        subs = list(dict.fromkeys(subs))
        if not subs:
            return None
        if len(subs) == 1:
            return rest + subs[0][1:]
        return rest + (("x", tuple(subs)),)

    def _alternatives_step(self, rest: tuple, subs: tuple, b: int):
        """Byte ``b`` to every alternative: those that go on stay alternatives; if none goes
        on and one had ended before ``b``, ``b`` goes to ``rest``. When some go on, ``b`` is
        not one that may follow a whole value: the alternatives read the same bytes at the
        same depth, so containers close together, and a value that ended by itself (a
        number, a literal) is followed by ``,`` ``}`` ``]`` or whitespace, which continue no
        number or literal (strings end only at their quote)."""
        results = [self.step(sub, b) for sub in subs]
        going = self._alternatives(rest, [r for r in results if r is not None and r is not _END])
        if going is not None or not any(r is _END for r in results):
            return going
        return self.step(rest, b) if rest else None

    def _delegated(self, rest: tuple, frame: tuple, b: int) -> tuple | None:
        _, node, js = frame
        nxt = json_mode.step(js, b)
        if nxt is not None:
            if nxt[0] == "end":  # the value is whole (a string, literal or container)
                return rest
            if self.nodes[node][0] == "integer" and nxt[0] in ("nd", "ne"):
                return None  # no fraction or exponent in an integer
            return rest + (("d", node, nxt),)
        if js[0] in json_mode._NUMBER_END and not js[1]:  # this number ended before b
            return self.step(rest, b)
        return None

    def _object_step(self, rest: tuple, frame: tuple, b: int) -> tuple | None:
        _, node, phase, seen, key, ws = frame
        _, names, children, required = self.nodes[node]
        unseen = [i for i in range(len(names)) if not seen >> i & 1]
        if phase == "key":
            if b == 0x22:
                hit = next((i for i in unseen if names[i] == key), None)
                return None if hit is None else rest + (("o", node, "colon", seen, hit, 0),)
            grown = key + bytes((b,))
            if any(names[i].startswith(grown) for i in unseen):
                return rest + (("o", node, "key", seen, grown, 0),)
            return None
        if b in _WS:
            return None if ws >= MAX_WS else rest + (frame[:-1] + (ws + 1,),)
        if phase == "colon":
            if b != 0x3A:
                return None
            after = ("o", node, "after", seen | (1 << key), None, 0)
            return rest + (after, ("v", children[key], MAX_WS))
        closes = b == 0x7D and required & ~seen == 0
        if phase == "after":
            if closes:
                return rest
            return rest + (("o", node, "k", seen, None, 0),) if b == 0x2C and unseen else None
        # k0 / k: a key's quote, or (k0) the closing brace
        if b == 0x22 and unseen:
            return rest + (("o", node, "key", seen, b"", 0),)
        return rest if phase == "k0" and closes else None

    def _array_step(self, rest: tuple, frame: tuple, b: int) -> tuple | None:
        """``("a", node, phase, ws, count)``: ``count`` items so far (kept no higher than
        the bounds need, so a long array does not make new states)."""
        _, node, phase, ws, count = frame
        if b in _WS:
            return None if ws >= MAX_WS else rest + (frame[:3] + (ws + 1, count),)
        _, item, lo, hi = self.nodes[node]
        if b == 0x5D:
            return rest if count >= lo else None
        more = min(count + 1, max(lo, hi or 0))
        if phase == "a0":
            return (
                None if hi == 0 else self._start(rest + (("a", node, "after", 0, more),), item, b)
            )
        if b == 0x2C and (hi is None or count < hi):
            return rest + (("a", node, "after", 0, more), ("v", item, MAX_WS))
        return None

    def accepts(self, text: bytes | str) -> bool:
        """Whether ``text`` is a whole value of this schema (as the recognizer reads it)."""
        state: tuple | None = self.start_state()
        for b in text.encode() if isinstance(text, str) else text:
            state = self.step(state, b)
            if state is None:
                return False
        return self.complete(state)

    @staticmethod
    def string_of(state: tuple):
        """Where ``state`` stands inside a string, `json_mode.string_of` of the innermost
        delegated value (the trie's shortcut), else `json_mode.NOT_STRING`."""
        if state and state[-1][0] == "d":
            return json_mode.string_of(state[-1][2])
        if state and state[-1][0] == "x":  # inside a string only if every alternative is
            where = {JsonSchema.string_of(sub) for sub in state[-1][1]}
            return where.pop() if len(where) == 1 else json_mode.NOT_STRING
        return json_mode.NOT_STRING
