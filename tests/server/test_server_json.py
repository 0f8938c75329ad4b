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


def _guided_choices(json_app, fmt: dict, max_tokens: int, seed: int, **guide) -> list[dict]:
    """Four sampled choices of "data:" with ``response_format=fmt``, checked equal to
    `LLM.generate` with ``guide`` (``json_mode`` / ``json_schema``) and the same seeds."""
    client, ref = json_app
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": "data:", "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "n": 4, "response_format": fmt}  # fmt: skip
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ids = ref.tokenizer.encode("data:")
    want = [ref.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                               seed=seed + j, **guide))[0] for j in range(4)]  # fmt: skip
    assert [c["text"] for c in choices] == [w.text for w in want]
    return choices


def test_completions_json_object(json_app):
    choices = _guided_choices(json_app, {"type": "json_object"}, 100, 11, json_mode=True)
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
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "strict": True,
                                                  "schema": SCHEMA}}  # fmt: skip
    choices = _guided_choices(json_app, fmt, 60, 5, json_schema=SCHEMA)
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
    client = json_app[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "x", "prompt": "data:", "response_format": bad}
    body["model"] = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "properties.a: keyword 'format'" in err["message"]


TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {}


@pytest.fixture(scope="module")
def tool_app(tmp_path_factory):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from kvplan.engine.llm import LLM
    from kvplan.server.app import build_app

    folder = make_json_model_folder(tmp_path_factory.mktemp("tool_served"), seed=4)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    llm = LLM(str(folder), device="cpu")
    with TestClient(build_app(llm, api_key=API_KEY)) as client:
        yield client, llm


def _chat(client, **body):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "weather?"}], **body}
    return client.post("/v1/chat/completions", json=body, headers=auth)


def test_forced_tool_calls(tool_app):
    """``tool_choice`` naming a function, or ``"required"`` over two: every choice that ends
    is a ``tool_calls`` answer whose name is a tool's and whose arguments are an instance of
    its parameters; the text equals `LLM.generate` with the call's recognizer."""
    from kvplan.engine.json_schema import JsonSchema

    client, llm = tool_app
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, tools=[WEATHER, CLOCK], tool_choice=named, n=4, temperature=1.0,
              seed=3, max_tokens=60)  # fmt: skip
    assert r.status_code == 200, r.text
    calls = 0
    for c in r.json()["choices"]:
        if c["finish_reason"] == "length":
            continue
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        args = json.loads(call["function"]["arguments"])
        assert args["city"] in ("Paris", "Oslo") and set(args) <= {"city", "days"}
        calls += 1
    assert calls >= 2
    r = _chat(client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0,
              max_tokens=60)  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "weather?"}],
                                               tools=[WEATHER, CLOCK], tokenize=True,
                                               add_generation_prompt=True)  # fmt: skip
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    schema = JsonSchema.tool_call([("get_weather", WEATHER["function"]["parameters"]),
                                   ("get_time", {"type": "object", "properties": {}})])  # fmt: skip
    want = llm.generate([prompt], SamplingParams(max_tokens=60, json_schema=schema))[0]
    if choice["finish_reason"] == "tool_calls":
        call = choice["message"]["tool_calls"][0]["function"]
        assert json.loads(want.text) == {"name": call["name"],
                                         "arguments": json.loads(call["arguments"])}  # fmt: skip
    else:
        assert choice["message"]["content"] == want.text


def test_streamed_tool_call_and_tool_messages(tool_app):
    client, _ = tool_app
    named = {"type": "function", "function": {"name": "get_time"}}
    history = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]  # fmt: skip
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "messages": history, "tools": [CLOCK], "tool_choice": named,
            "stream": True, "max_tokens": 40, "temperature": 1.0, "seed": 1, "n": 4}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [e["choices"][0] for e in events]
    assert [d["delta"]["role"] for d in deltas[:4]] == ["assistant"] * 4
    ends = [d for d in deltas if d["finish_reason"] is not None]
    assert sorted(d["index"] for d in ends) == [0, 1, 2, 3]
    for d in deltas:  # no text before a choice's end
        assert not d["delta"].get("content") or d["finish_reason"] == "length"
    calls = [d for d in ends if d["finish_reason"] == "tool_calls"]
    assert calls  # the arguments are "{}" with optional whitespace inside
    for d in calls:
        (call,) = d["delta"]["tool_calls"]
        assert call["function"] == {"name": "get_time", "arguments": "{}"} and call["index"] == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, the default with tools
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"d": {"type": "string", "format": "date"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_tool_requests_refused_name_the_field(tool_app, body, param):
    client, _ = tool_app
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_choice_none_shows_the_tools_to_the_template(tool_app):
    client, llm = tool_app
    r = _chat(client, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    plain = _chat(client, max_tokens=3, temperature=0).json()["usage"]
    assert usage["prompt_tokens"] > plain["prompt_tokens"]  # "tools: get_weather get_time"
