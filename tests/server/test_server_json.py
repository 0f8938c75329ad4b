"""``response_format={"type": "json_object"}`` over HTTP on a model whose byte-level tokenizer
can spell JSON: the choices equal `LLM.generate` with ``json_mode=True`` (same seeds), each
text is a JSON object prefix, and the finished ones parse as objects."""

from __future__ import annotations

import json

import pytest
from server_testlib import API_KEY

from kvplan.engine.json_mode import complete, start_state, step
from kvplan.engine.sampling import SamplingParams
from tests.engine.test_json_mode import make_json_model_folder


@pytest.fixture(scope="module")
def json_app(tmp_path_factory):
    from fastapi.testclient import TestClient

    from kvplan.engine.llm import LLM
    from kvplan.server.app import build_app

    folder = make_json_model_folder(tmp_path_factory.mktemp("json_served"), seed=1)
    llm = LLM(str(folder), device="cpu", chat_template=False)
    ref = LLM(str(folder), device="cpu", chat_template=False)
    with TestClient(build_app(llm, api_key=API_KEY)) as client:
        yield client, ref


def test_completions_json_object(json_app):
    client, ref = json_app
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": "data:", "max_tokens": 100, "temperature": 1.0,
            "seed": 11, "n": 4, "response_format": {"type": "json_object"}}  # fmt: skip
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ids = ref.tokenizer.encode("data:")
    want = [ref.generate([ids], SamplingParams(max_tokens=100, temperature=1.0, seed=11 + j,
                                               json_mode=True))[0] for j in range(4)]  # fmt: skip
    assert [c["text"] for c in choices] == [w.text for w in want]
    done = 0
    for c in choices:
        st = start_state()
        for b in c["text"].encode("utf-8"):
            st = step(st, b)
            assert st is not None, c["text"]
        if c["finish_reason"] == "stop":
            assert complete(st) and isinstance(json.loads(c["text"]), dict)
            done += 1
    assert done >= 1


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
    "required": ["color"],
}


def test_completions_json_schema(json_app):
    """``response_format={"type": "json_schema", ...}``: the choices equal `LLM.generate`
    with ``json_schema`` (same seeds); finished ones are instances of the schema; an
    unsupported schema is a 400 naming the keyword's path."""
    client, ref = json_app
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "strict": True,
                                                  "schema": SCHEMA}}  # fmt: skip
    body = {"model": model, "prompt": "data:", "max_tokens": 60, "temperature": 1.0,
            "seed": 5, "n": 4, "response_format": fmt}  # fmt: skip
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ids = ref.tokenizer.encode("data:")
    want = [ref.generate([ids], SamplingParams(max_tokens=60, temperature=1.0, seed=5 + j,
                                               json_schema=SCHEMA))[0] for j in range(4)]  # fmt: skip
    assert [c["text"] for c in choices] == [w.text for w in want]
    done = 0
    for c in choices:
        if c["finish_reason"] == "stop":
            value = json.loads(c["text"])
            assert value["color"] in ("red", "green") and set(value) <= {"color", "n"}
            assert type(value.get("n", 0)) is int
            done += 1
    assert done >= 1
    bad = {**fmt, "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "format": "date"}}}}}  # fmt: skip
    r = client.post("/v1/completions", json={**body, "response_format": bad}, headers=auth)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "properties.a: keyword 'format'" in err["message"]
