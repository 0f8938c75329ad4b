"""``tool_choice: "auto"`` with a Hermes-style chat template (``<tool_call>`` blocks, as
Qwen2.5 / Qwen3 write calls): the parser of such answers, and over HTTP a model made to answer
with a block (one vocabulary token holding it, forced by ``logit_bias``) gets ``tool_calls``,
streamed or not, with the text around the block as content."""

from __future__ import annotations

import json

import pytest
from server_testlib import API_KEY, make_model_folder, make_tokenizer

from kvplan.server.protocol import hermes_tool_calls

BLOCK = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "<|assistant|>  (calls go in <tool_call></tool_call>)"
)
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_hermes_blocks_are_parsed():
    names = ("get_time", "get_weather")
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time"}</tool_call> done')  # fmt: skip
    content, calls = hermes_tool_calls(text, names)
    assert content == "Sure. \n done"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                     {"name": "get_time", "arguments": "{}"}]  # fmt: skip
    for bad in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # not a tool
                "<tool_call>{not json}</tool_call>",
                '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
                '<tool_call>{"name": "get_time"}'):  # fmt: skip
        assert hermes_tool_calls("a " + bad, names) == (("a " + bad).strip(), [])


@pytest.fixture(scope="module")
def hermes_app(tmp_path_factory):
    from fastapi.testclient import TestClient

    from kvplan.engine.llm import LLM
    from kvplan.server.app import build_app

    folder = make_model_folder(tmp_path_factory.mktemp("hermes"))
    tok = make_tokenizer()
    tok.add_tokens([BLOCK])
    tok.chat_template = HERMES
    tok.save_pretrained(str(folder))
    llm = LLM(str(folder), device="cpu")
    block_id = tok.convert_tokens_to_ids(BLOCK)
    with TestClient(build_app(llm, api_key=API_KEY)) as client:
        yield client, block_id


def _body(client, block_id: int, **extra) -> dict:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    return {"model": model, "messages": [{"role": "user", "content": "a b"}], "tools": [CLOCK],
            "max_tokens": 1, "temperature": 0, "logit_bias": {str(block_id): 100}, **extra}  # fmt: skip


def test_auto_tool_call_answer(hermes_app):
    client, block_id = hermes_app
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = client.post("/v1/chat/completions", json=_body(client, block_id), headers=auth)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"  # max_tokens cut it (no EOS yet)
    msg = choice["message"]
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    plain = _body(client, block_id, logit_bias=None, tool_choice="auto")
    r = client.post("/v1/chat/completions", json=plain, headers=auth)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_auto_tool_call_streamed(hermes_app):
    client, block_id = hermes_app
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = _body(client, block_id, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
        assert r.status_code == 200
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks]
    assert not any(d["delta"].get("content") for d in deltas)  # the block is not text
    last = deltas[-1]
    assert last["finish_reason"] == "length"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_time"


def test_streamed_text_stops_before_a_block():
    from kvplan.server.app import _before_tool_call

    assert _before_tool_call("Sure <tool_call>{") == "Sure "
    assert _before_tool_call("Sure <tool_") == "Sure "  # may be a block's start: held back
    assert _before_tool_call("a < b") == "a < b"
    assert _before_tool_call("x <") == "x "
