"""Logprobs over HTTP: chat ``logprobs`` / ``top_logprobs``, completions ``logprobs`` and
``echo`` (with ``max_tokens: 0`` for pure scoring), streamed and not, against the reference
engine (`LLM.generate` with logprobs) and teacher-forced logits (`prompt_logits`)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_testlib import API_KEY

from kvplan.engine.sampling import SamplingParams
from kvplan.engine.scoring import prompt_logits

TOL = dict(abs=1e-5, rel=1e-5)


def _client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(served, path, body):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(served.url + path, json=body, headers=headers, timeout=30)


def _text(served, t):
    return served.ref.tokenizer.decode([t], skip_special_tokens=False)


def test_completion_logprobs_equal_generate(served):
    ids = served.ref.tokenizer.encode("w1 w2 c d")
    ref = served.ref.generate([ids], SamplingParams(max_tokens=8, logprobs=3))[0]
    out = _client(served).completions.create(
        model="tiny-llama", prompt="w1 w2 c d", max_tokens=8, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [_text(served, t) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], **TOL)
    for top, e in zip(lp.top_logprobs, ref.logprobs):
        assert len(top) == 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert list(top.values()) == pytest.approx([v for _, v in e.top], **TOL)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert served.all_blocks_free()


def test_echo_scores_the_prompt(served):
    ids = served.ref.tokenizer.encode("a b w5 w6 c w7 z")
    want = prompt_logits(served.ref.engine, ids, chunk_size=3).log_softmax(-1)
    r = _post(served, "/v1/completions", {"model": "tiny-llama", "prompt": ids, "max_tokens": 0,
                                         "echo": True, "logprobs": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == served.ref.tokenizer.decode(ids, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert lp["tokens"] == [_text(served, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [float(want[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, **TOL)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)
    # echo with generation: the prompt's entries, then the completion's
    r = _post(served, "/v1/completions", {"model": "tiny-llama", "prompt": ids, "max_tokens": 3,
                                         "echo": True, "logprobs": 0, "temperature": 0})  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, **TOL)
    assert lp["top_logprobs"][-1] == {}
    served.wait_idle()
    assert served.all_blocks_free()


def test_chat_logprobs_equal_generate(served):
    msgs = [{"role": "user", "content": "w3 w4 c"}]
    ids = served.ref.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = served.ref.generate([ids], SamplingParams(max_tokens=6, logprobs=2))[0]
    out = _client(served).chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [_text(served, t) for t in ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], **TOL)
    for c, e in zip(content, ref.logprobs):
        assert c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [_text(served, a) for a, _ in e.top]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in e.top], **TOL)
    plain = _client(served).chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=6, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_non_streamed(served):
    client = _client(served)
    msgs = [{"role": "user", "content": "d e w9"}]
    kw = dict(model="tiny-llama", max_tokens=10, temperature=0.9, seed=4)
    full = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=1, **kw)
    chunks = list(
        client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=1, stream=True, **kw)
    )  # fmt: skip
    got = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]  # fmt: skip
    want = full.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in got] == [(c.token, c.logprob) for c in want]
    # completions, with echo: the prompt chunk first
    body = {"model": "tiny-llama", "prompt": "a b c", "max_tokens": 5, "temperature": 0,
            "logprobs": 1, "echo": True}  # fmt: skip
    whole = _post(served, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(p["text"] for p in parts) == whole["text"]
    merged = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for p in parts:
        for k in merged:
            merged[k] += (p["logprobs"] or {}).get(k, [])
    assert merged == whole["logprobs"]
    served.wait_idle()
    assert served.all_blocks_free()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ],
)
def test_bad_logprob_params(served, path, body, param):
    base = {"model": "tiny-llama"}
    base.update({"prompt": "a b"} if path.endswith("/completions") and "chat" not in path
                else {"messages": [{"role": "user", "content": "a"}]})  # fmt: skip
    r = _post(served, path, {**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
