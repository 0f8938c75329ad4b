"""Structured output (`kvplan.engine.json_schema`): the schema recognizer against an
independent validator written here over Python's ``json`` (every prefix of a random valid
instance accepted, whole texts -- instances and random edits of them -- accepted exactly when
the validator says so), the schema's token masks against a per-token brute force, unsupported
schemas named by path, and the engine: guided completions of a random-weight model are
prefixes of valid instances, and those that end on EOS parse and validate."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvplan.engine.json_mode import TokenTrie
from kvplan.engine.json_schema import JsonSchema
from kvplan.engine.sampling import SamplingParams
from tests.engine.test_json_mode import guided_outputs, make_json_model_folder, random_edit

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "alive": {"type": "boolean"},
        "nick": {"type": ["string", "null"]},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "bb", 1, None, True]},
            "minItems": 1,
            "maxItems": 3,
        },
        "pet": {"$ref": "#/$defs/pet"},
        "extra": {},
        "kind": {"const": "person"},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
    "$defs": {
        "pet": {
            "type": "object",
            "properties": {
                "species": {"enum": ["cat", "dog"]},
                "friends": {"type": "array", "items": {"$ref": "#/$defs/pet"}},
            },  # fmt: skip
            "required": ["species"],
        }
    },
}
MATRIX = {"type": "array", "items": {"type": "array", "items": {"anyOf": [{"type": "number"},
                                                                          {"type": "null"}]}}}  # fmt: skip
OPEN = {"type": "object", "properties": {"any": {"type": "object"}, "list": {"type": "array"}}}
UNION = {  # alternatives that start alike: read side by side
    "type": "array",
    "items": {"anyOf": [
        {"type": "integer"}, {"enum": [1, 12.5, "a"]},
        {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"type": "string"}, "z": {"type": "null"}}},
    ]},
}  # fmt: skip
SCHEMAS = [PERSON, MATRIX, OPEN, UNION]


def _validate(v, s, defs) -> bool:
    """The schema subset's meaning, written independently of the recognizer."""
    if s is True or s == {}:
        return True
    if "$ref" in s:
        return _validate(v, defs[s["$ref"].rsplit("/", 1)[1]], defs)
    if "const" in s or "enum" in s:
        opts = [s["const"]] if "const" in s else s["enum"]
        return any(type(v) is type(o) and v == o for o in opts)
    if "anyOf" in s:
        return any(_validate(v, b, defs) for b in s["anyOf"])
    kinds = s["type"] if isinstance(s["type"], list) else [s["type"]]
    return any(_validate_kind(v, k, s, defs) for k in kinds)


def _validate_kind(v, kind, s, defs) -> bool:
    if kind == "object":
        if not isinstance(v, list) or any(not isinstance(p, tuple) for p in v):
            return False  # objects come as lists of (key, value) pairs (duplicates kept)
        keys = [k for k, _ in v]
        if "properties" not in s:
            return len(set(keys)) == len(keys)
        props = s["properties"]
        return (len(set(keys)) == len(keys) and all(k in props for k in keys)
                and all(r in keys for r in s.get("required", []))
                and all(_validate(x, props[k], defs) for k, x in v))  # fmt: skip
    if kind == "array":
        if not isinstance(v, _Array) or not s.get("minItems", 0) <= len(v) <= s.get(
            "maxItems", len(v)
        ):
            return False
        return all(_validate(x, s.get("items", {}), defs) for x in v)
    if kind == "string":
        return isinstance(v, str)
    if kind == "integer":
        return type(v) is int
    if kind == "number":
        return type(v) in (int, float)
    if kind == "boolean":
        return type(v) is bool
    return v is None


class _Array(list):
    pass


def _parse(text: str):
    """json.loads with objects as pair lists and arrays tagged; None where it is not one
    JSON text without surrounding whitespace, NaN / Infinity or escaped keys."""
    if not text or text != text.strip():
        return None

    def no_constants(name):
        raise ValueError(name)

    try:
        return json.loads(text, object_pairs_hook=lambda pairs: [tuple(p) for p in pairs],
                          parse_constant=no_constants, cls=_ArrayDecoder)  # fmt: skip
    except (ValueError, RecursionError):
        return None


class _ArrayDecoder(json.JSONDecoder):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        plain = self.parse_array

        def parse_array(*args, **kwargs):
            values, end = plain(*args, **kwargs)
            return _Array(values), end

        self.parse_array = parse_array
        self.scan_once = json.scanner.py_make_scanner(self)


def _valid(text: str, schema) -> bool:
    v = _parse(text)
    return v is not None and _validate(v, schema, schema.get("$defs", {}))


def _has_escaped_key(text: str) -> bool:
    """Whether an object key is written with an escape (the recognizer takes keys as
    written; json.loads would unescape them)."""
    try:
        json.loads(text, object_pairs_hook=lambda p: None)
    except ValueError:
        return False
    return any("\\" in k for k in _raw_keys(text))


def _raw_keys(text: str):
    i, out = 0, []
    while (i := text.find('"', i)) >= 0:
        j = i + 1
        while text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        k = j + 1
        while k < len(text) and text[k] in " \t\r\n":
            k += 1
        if k < len(text) and text[k] == ":":
            out.append(text[i + 1 : j])
        i = j + 1
    return out


def _instance(s, rng: random.Random, defs, depth=0):
    if s is True or s == {}:
        return rng.choice([1, "x", None, [1, {"q": [True]}], {"a": {}}])
    if "$ref" in s:
        return _instance(defs[s["$ref"].rsplit("/", 1)[1]], rng, defs, depth + 1)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return rng.choice(s["enum"])
    if "anyOf" in s:
        return _instance(rng.choice(s["anyOf"]), rng, defs, depth)
    kind = s["type"]
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "object":
        if "properties" not in s:
            return {"k": rng.choice([1, [], "\u00e9"])} if rng.random() < 0.7 else {}
        props = s["properties"]
        keys = [
            k for k in props if k in s.get("required", []) or (depth < 3 and rng.random() < 0.6)
        ]
        rng.shuffle(keys)
        return {k: _instance(props[k], rng, defs, depth + 1) for k in keys}
    if kind == "array":
        lo = s.get("minItems", 0)
        n = rng.randint(lo, s.get("maxItems", lo + 3)) if depth < 3 else lo
        return [_instance(s.get("items", {}), rng, defs, depth + 1) for _ in range(n)]
    if kind == "string":
        return "".join(rng.choice('ab"\\\n\u00e9\u20ac ') for _ in range(rng.randrange(5)))
    if kind == "integer":
        return rng.choice([0, -7, 123456789012])
    if kind == "number":
        return rng.choice([0, 2.5, -1e-7, 3e21, 12])
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _texts(schema, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    defs = schema.get("$defs", {})
    return [json.dumps(_instance(schema, rng, defs), indent=rng.choice([None, 1, "\t"]),
                       ensure_ascii=rng.random() < 0.5) for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_prefix_of_an_instance_is_accepted(index):
    schema = SCHEMAS[index]
    js = JsonSchema(schema)
    for text in _texts(schema, 60, index):
        assert _valid(text, schema), text
        st = js.start_state()
        for b in text.encode("utf-8"):
            st = js.step(st, b)
            assert st is not None, text
        assert js.complete(st), text


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_whole_texts_agree_with_the_validator(index):
    schema = SCHEMAS[index]
    js = JsonSchema(schema)
    rng = random.Random(100 + index)
    alphabet = list('{}[],:" 0123456789-.etrufalsn') + ["null", '"a"', '"name"', '"age"', "1.5"]
    checked = {True: 0, False: 0}
    for text in _texts(schema, 60, 50 + index):
        for _ in range(12):
            edited = random_edit(text, rng, alphabet, rng.randrange(1, 3))
            if "\\" in edited and _has_escaped_key(edited):
                continue  # keys are matched as written (test_escaped_keys_are_not_names)
            want = _valid(edited, schema)
            assert js.accepts(edited) == want, edited
            checked[want] += 1
    assert checked[True] > 20 and checked[False] > 300


def test_array_bounds():
    js = JsonSchema({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3})
    assert [js.accepts(t) for t in ("[]", "[1]", "[1,2]", "[1, 2, 3]", "[1,2,3,4]")] == [
        False, False, True, True, False]  # fmt: skip
    any_two = JsonSchema({"type": "array", "minItems": 2})  # items of any kind
    assert any_two.accepts('[{"a": 1}, "x", 3]') and not any_two.accepts("[null]")
    assert JsonSchema({"type": "array", "maxItems": 0}).accepts("[ ]")
    assert not JsonSchema({"type": "array", "maxItems": 0}).accepts("[1]")


def test_escaped_keys_are_not_names():
    js = JsonSchema(PERSON)
    assert js.accepts('{"name":"x","age":1,"kind":"person"}')
    assert not js.accepts('{"n\\u0061me":"x","age":1,"kind":"person"}')
    assert JsonSchema(OPEN).accepts('{"any":{"k\\u00e9":1}}')  # any object: JSON's own keys


def test_schema_masks_equal_brute_force():
    rng = random.Random(3)
    alphabet = b'{}[],:"\\ 0123456789-.eEtrufalsnxyamgk\n\xc3\xa9'
    pieces = [None, b"{", b"}", b'"', b'{"', b'":', b'"}', b"true", b" ", b'"name', b'name":']
    pieces += [bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(600)]
    base = TokenTrie(pieces)
    for schema in SCHEMAS:
        js = JsonSchema(schema)
        view = base.view(js)
        states = {js.start_state()}
        for text in _texts(schema, 15, 7):
            st = js.start_state()
            for b in text.encode("utf-8"):
                st = js.step(st, b)
                states.add(st)
        assert len(states) > 10
        for st in states:
            if js.complete(st):
                continue
            want = np.zeros(len(pieces), dtype=bool)
            for tid, piece in enumerate(pieces):
                cur = st
                for b in piece or b"":
                    cur = None if cur is None else js.step(cur, b)
                want[tid] = piece is not None and cur is not None
            assert np.array_equal(view.allowed(st), want), st


@pytest.mark.parametrize(
    "schema, path",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}},
         r"json_schema\.properties\.a: keyword 'pattern'"),
        ({"type": "object", "properties": {}, "additionalProperties": True},
         r"json_schema\.additionalProperties must be false"),
        ({"type": "string"}, "the root must be an object or an array"),
        ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, r"\$ref='#/x'"),
        ({"type": "object", "properties": {"a": {"type": "date"}}}, r"\.a\.type='date'"),
        ({"type": "object", "properties": {"a\"b": {}}}, "needs escaping"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required must list"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "maxItems=1 is below minItems=3"),
        ({"type": "array", "minItems": -1}, r"minItems=-1 must be an int >= 0"),
    ],
)  # fmt: skip
def test_unsupported_schemas_name_their_path(schema, path):
    with pytest.raises(ValueError, match=path):
        SamplingParams(json_schema=schema)


def test_json_schema_params():
    p = SamplingParams(json_schema=json.dumps(OPEN), max_tokens=8)
    assert p.json_mode and isinstance(p.json_schema, JsonSchema) and p.adjusts_logits
    assert p.json_schema == JsonSchema(OPEN) and hash(p.json_schema) == hash(JsonSchema(OPEN))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(json_schema=OPEN, ignore_eos=True)
    with pytest.raises(ValueError, match="json_schema: not JSON"):
        SamplingParams(json_schema="{")


SMALL = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": [1, 2]}},
    },
    "required": ["color", "ok"],
}


@pytest.fixture(scope="module")
def schema_llm(tmp_path_factory):
    from kvplan import LLM

    folder = make_json_model_folder(tmp_path_factory.mktemp("schema_llama"), seed=2)
    return LLM(str(folder), device="cpu"), str(folder)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_follow_the_schema(schema_llm, async_scheduling):
    llm, _ = schema_llm
    js = JsonSchema(SMALL)
    finished = 0
    for out, data in guided_outputs(llm, async_scheduling, 80, json_schema=SMALL):
        st = js.start_state()
        for b in data:
            st = js.step(st, b)
            assert st is not None, data
        if out.finish_reason == "stop":
            assert js.complete(st) and out.token_ids[-1] == llm.tokenizer.eos_token_id
            assert _valid(out.text, SMALL), out.text
            finished += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 80
    assert finished >= 2


def test_cli_generate_takes_a_schema_file(schema_llm, tmp_path, capsys):
    from kvplan.cli import main

    llm, folder = schema_llm
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SMALL))
    ids = llm.tokenizer.encode("say")
    argv = ["generate", "--model", folder, "--device", "cpu", "--max-tokens", "40",
            "--token-ids", ",".join(map(str, ids))]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--json-schema", str(path)]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    want = llm.generate([ids], SamplingParams(max_tokens=40, json_schema=SMALL))[0]
    assert got == want.token_ids
    bad = '{"type": "object", "properties": {"a": {"minimum": 1}}}'
    assert main([*argv, "--json-schema", bad]) == 2
    assert "json_schema.properties.a: keyword 'minimum'" in capsys.readouterr().err


def test_pydantic_schemas_and_their_instances():
    """A schema as pydantic writes it (titles, defaults, ``$defs`` with a recursive ``$ref``,
    ``Optional`` as ``anyOf`` with null, ``Literal`` as an enum): every instance pydantic
    dumps is accepted, and what the recognizer accepts pydantic validates."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal, Optional, Union

    class Pet(pydantic.BaseModel):
        species: Literal["cat", "dog"]
        friends: list[Pet] = []

    class Person(pydantic.BaseModel):
        name: str
        age: int
        height: Optional[float] = None  # noqa: UP045 (pydantic's Optional spelling)
        pet: Optional[Pet] = None  # noqa: UP045
        tags: list[str]

    js = JsonSchema(Person.model_json_schema())
    rng = random.Random(5)
    for i in range(40):
        pet = Pet(species=rng.choice(["cat", "dog"]),
                  friends=[Pet(species="dog")] * rng.randrange(3))  # fmt: skip
        person = Person(name="n\u00e9" * rng.randrange(3), age=rng.randrange(-5, 99),
                        height=rng.choice([None, 1.75, 2]), pet=rng.choice([None, pet]),
                        tags=["t"] * rng.randrange(3))  # fmt: skip
        text = person.model_dump_json(indent=rng.choice([None, 2]), exclude_defaults=i % 2 == 0)
        assert js.accepts(text), text
        Person.model_validate_json(text)
    for text in ['{"name":"a","age":1,"tags":[],"pet":{"species":"cat","friends":[]}}',
                 '{"tags":["x"],"age":-0,"name":"","height":1e-3}']:  # fmt: skip
        assert js.accepts(text)
        Person.model_validate_json(text)

    class Cat(pydantic.BaseModel):
        meow: bool

    class Home(pydantic.BaseModel):  # a union of models: objects read side by side
        pets: list[Union[Cat, Pet]]  # noqa: UP007 (pydantic's Union spelling)

    home = JsonSchema(Home.model_json_schema())
    for text in ('{"pets": [{"meow": true}, {"species": "dog"}]}', '{"pets": []}'):
        assert home.accepts(text)
        Home.model_validate_json(text)
    assert not home.accepts('{"pets": [{"meow": true, "species": "dog"}]}')
    for text in ['{"name":"a","age":1.5,"tags":[]}', '{"name":"a","age":1}',
                 '{"name":"a","age":1,"tags":[],"pet":{"species":"cow"}}']:  # fmt: skip
        assert not js.accepts(text)
        with pytest.raises(pydantic.ValidationError):
            Person.model_validate_json(text, strict=True)


def test_whitespace_runs_are_bounded():
    """At most MAX_WS whitespace bytes in a row between tokens, in JSON mode and under a
    schema (a weak model cannot fill its tokens with blank space); inside strings any."""
    from kvplan.engine.json_mode import MAX_WS, complete, start_state, step

    def json_ok(text: str) -> bool:
        st = start_state()
        for b in text.encode():
            st = step(st, b)
            if st is None:
                return False
        return complete(st)

    js = JsonSchema(OPEN)
    for sep in (" " * MAX_WS, "\n" + "\t" * (MAX_WS - 1)):
        for text in ('{"any":' + sep + '{"a": [1,' + sep + "2]}}", "{" + sep + "}",
                     '{"list": [' + sep + '"' + " " * 40 + '"' + sep + "]" + sep + "}"):  # fmt: skip
            assert json_ok(text) and js.accepts(text), text
            longer = text.replace(sep, sep + " ", 1)
            assert not json_ok(longer) and not js.accepts(longer), longer


def test_mask_memos_are_bounded():
    """A trie keeps at most MEMO_BYTES of masks (VIEW_MEMO_BYTES a schema view): a memo at
    its bound starts over."""
    pieces = [bytes([b]) for b in b'{}[]":, 0123456789abcdefnrstul'] + [None]
    base = TokenTrie(pieces)
    assert base._memo_max == TokenTrie.MEMO_BYTES // len(pieces)
    js = JsonSchema(SCHEMAS[0])
    view = base.view(js)
    assert view._memo_max == TokenTrie.VIEW_MEMO_BYTES // len(pieces)
    view._memo_max = 5
    st = js.start_state()
    for b in b'{"name": "abc", "age": 12, "kind": "person"}':
        view.allowed(st)
        assert len(view._memo) <= 5
        st = js.step(st, b)
    assert js.complete(st) and len(base._memo) == 0  # the view's masks are its own
