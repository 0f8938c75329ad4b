"""``kvplan serve`` over HTTP, driven by the official ``openai`` client and raw ``httpx``:
greedy outputs equal `LLM.generate` on a separate engine, concurrent streams equal their
one-at-a-time outputs and free every block, disconnects abort, errors have the OpenAI shape."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from server_testlib import API_KEY

from kvplan.engine.sampling import SamplingParams

PROMPTS = ["a b c", "d e f g", "w1 w2 w3 w4 w5", "z y x", "hello a", "w100 b w7"]


def _client(served, **kw):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, **kw)


def _ref(served, ids_list, params):
    """Reference outputs: the prompts one at a time on the reference engine."""
    return [served.ref.generate([ids], params)[0] for ids in ids_list]


def _enc(served, text):
    return served.ref.tokenizer.encode(text)


def _chat_ids(served, messages):
    ids = served.ref.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _metric(served, name: str) -> float:
    text = httpx.get(served.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_models_health_metrics(served):
    models = _client(served).models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    text = httpx.get(served.url + "/metrics").text
    for name in (
        "kvplan_requests_running",
        "kvplan_requests_waiting",
        "kvplan_requests_waiting_for_shared_prefix 0",
        'kvplan_kv_blocks_used{pool="0"}',
        "kvplan_generation_tokens_total",
        'kvplan_time_to_first_token_seconds_bucket{le="+Inf"}',
        "kvplan_time_per_output_token_seconds_count",
    ):
        assert name in text, name


def test_completions_greedy_equal_generate(served):
    client = _client(served)
    ids = [_enc(served, p) for p in PROMPTS[:3]]
    refs = _ref(served, ids, SamplingParams(max_tokens=12))
    out = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[:3], max_tokens=12, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert [c.finish_reason for c in out.choices] == [r.finish_reason for r in refs]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # token-id prompts give the same
    out2 = client.completions.create(model="tiny-llama", prompt=ids[1], max_tokens=12, temperature=0)  # fmt: skip
    assert out2.choices[0].text == refs[1].text
    assert served.all_blocks_free()


def test_chat_greedy_equals_generate(served):
    client = _client(served)
    msgs = [{"role": "system", "content": "a b"}, {"role": "user", "content": "w3 w4 c"}]
    ref = _ref(served, [_chat_ids(served, msgs)], SamplingParams(max_tokens=10))[0]
    out = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_completion_tokens=10, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(_chat_ids(served, msgs))
    assert out.usage.completion_tokens == len(ref.token_ids)


def test_usage_reports_prompt_tokens_served_by_the_prefix_cache(served):
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field) and the
    ``kvplan_prompt_tokens_cached_total`` counter: a repeated prompt resumes from its cached
    full blocks (block_size 8, one token left to compute)."""
    client = _client(served)
    prompt = " ".join(f"w{i}" for i in range(300, 340))
    n = len(_enc(served, prompt))
    want = (n - 1) // 8 * 8
    assert want >= 16
    before = _metric(served, "kvplan_prompt_tokens_cached_total")
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == want
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want
    assert _metric(served, "kvplan_prompt_tokens_cached_total") >= before + 2 * want


def test_streaming_equals_non_streaming(served):
    client = _client(served)
    msgs = [{"role": "user", "content": "d e w9"}]
    full = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=16, temperature=0)  # fmt: skip
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama", messages=msgs, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # fmt: skip
    # raw SSE: every event is JSON, the stream ends with [DONE]
    body = {"model": "tiny-llama", "prompt": "a b c", "max_tokens": 8, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    ref = _ref(served, [_enc(served, "a b c")], SamplingParams(max_tokens=8))[0]
    assert streamed == ref.text


def test_concurrent_streams_batch_and_free_blocks(served):
    prompts = [f"w{i} {chr(97 + i % 26)} w{2 * i + 1}" for i in range(64)]
    lengths = [8 + (i * 7) % 25 for i in range(64)]
    refs = [
        served.ref.generate([_enc(served, p)], SamplingParams(max_tokens=n))[0]
        for p, n in zip(prompts, lengths)
    ]
    steps_before = served.llm.engine.num_steps

    async def one(client, p, n):
        stream = await client.completions.create(
            model="tiny-llama", prompt=p, max_tokens=n, temperature=0, stream=True
        )
        parts, reason = [], None
        async for c in stream:
            parts.append(c.choices[0].text)
            reason = c.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == [r.text for r in refs]
    assert [r[1] for r in results] == [r.finish_reason for r in refs]
    served.wait_idle()
    assert served.all_blocks_free() and served.engine.num_live == 0
    # continuous batching: far fewer steps than tokens
    tokens = sum(len(r.token_ids) for r in refs)
    assert served.llm.engine.num_steps - steps_before < tokens / 4


def test_seeded_sampling_and_n(served):
    client = _client(served)
    kw = dict(model="tiny-llama", prompt="a b", max_tokens=10, temperature=0.9, top_p=0.9, seed=5, n=2)  # fmt: skip
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    ids = _enc(served, "a b")
    refs = [
        served.ref.generate(
            [ids], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=s)
        )[0]  # fmt: skip
        for s in (5, 6)
    ]
    assert [c.text for c in a.choices] == [r.text for r in refs]


def test_stop_string_cut_in_stream_and_not(served):
    client = _client(served)
    ref = _ref(served, [_enc(served, "d e f g")], SamplingParams(max_tokens=12))[0]
    words = ref.text.split(" ")
    stop = words[3]
    expect = ref.text[: ref.text.find(stop)]
    kw = dict(model="tiny-llama", prompt="d e f g", max_tokens=12, temperature=0, stop=[stop])
    out = client.completions.create(**kw)
    assert out.choices[0].text == expect and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == expect


def _long_body(stream: bool) -> dict:
    return {"model": "tiny-llama", "prompt": "a b c", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def test_disconnects_abort_and_free_blocks(served):
    name = 'kvplan_requests_finished_total{finish_reason="abort"}'
    before = _metric(served, name)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", served.url + "/v1/completions", json=_long_body(True), headers=headers) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    served.wait_idle()
    assert served.all_blocks_free()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=_long_body(False), headers=headers, timeout=0.3)  # fmt: skip
    served.wait_idle()
    assert served.all_blocks_free()
    assert _metric(served, name) == before + 2


def _post(served, path, body, key=API_KEY, raw=None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if raw is not None:
        return httpx.post(served.url + path, content=raw, headers=headers)
    return httpx.post(served.url + path, json=body, headers=headers)


C, CH = "/v1/completions", "/v1/chat/completions"
P = {"model": "tiny-llama", "prompt": "a b"}
M = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}]}


def test_penalties_and_logit_bias_equal_generate(served):
    """OpenAI's presence / frequency penalties, logit_bias (token id strings) and vLLM's
    repetition_penalty and min_tokens reach the engine: the outputs equal `LLM.generate` with the same
    `SamplingParams`, and a +100 bias forces its token."""
    client = _client(served)
    ids = _enc(served, PROMPTS[2])
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    ref = _ref(served, [ids], SamplingParams(max_tokens=12, logit_bias={40: 3.0}, min_tokens=3,
                                             **kw))[0]  # fmt: skip
    out = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[2], max_tokens=12, temperature=0,
        presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"40": 3.0},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 3},
    )  # fmt: skip
    assert out.choices[0].text == ref.text
    plain = _ref(served, [ids], SamplingParams(max_tokens=12))[0]
    assert ref.token_ids != plain.token_ids  # the adjustments changed the output
    forced = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "a b"}], max_tokens=4,
        temperature=0, logit_bias={"40": 100},
    )  # fmt: skip
    word = served.ref.tokenizer.decode([40])
    assert forced.choices[0].message.content.split() == [word] * 4
    assert served.all_blocks_free()


def test_best_of_keeps_the_most_likely(served):
    """``best_of=4, n=2`` (seeded): the server samples 4 sequences per prompt (seeds 7..10,
    as ``n=4`` would) and returns the 2 with the highest mean log-probability per token,
    best first, without logprobs unless asked; usage counts all 8 completions. Reference:
    the same seeds on the reference engine, ranked here."""
    client = _client(served)
    prompts = PROMPTS[:2]
    kw = dict(model="tiny-llama", max_tokens=8, temperature=1.0, seed=7)
    out = client.completions.create(prompt=prompts, best_of=4, n=2, **kw)
    texts, generated = [], 0
    for p in prompts:
        refs = [
            served.ref.generate(
                [_enc(served, p)],
                SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j, logprobs=0),  # fmt: skip
            )[0]
            for j in range(4)
        ]
        generated += sum(len(r.token_ids) for r in refs)
        means = [sum(e.logprob for e in r.logprobs) / len(r.logprobs) for r in refs]
        assert len(set(means)) == 4  # distinct samples: the ranking is not a tie-break
        order = sorted(range(4), key=lambda j: -means[j])
        texts += [refs[j].text for j in order[:2]]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == texts
    assert all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == generated
    assert out.usage.prompt_tokens == sum(len(_enc(served, p)) for p in prompts)
    # best_of equal to n changes nothing; with logprobs asked the chosen ones carry theirs
    same = client.completions.create(prompt=prompts[0], best_of=2, n=2, **kw)
    plain = client.completions.create(prompt=prompts[0], n=2, **kw)
    assert [c.text for c in same.choices] == [c.text for c in plain.choices]
    lp = client.completions.create(prompt=prompts[0], best_of=3, logprobs=1, **kw)
    assert len(lp.choices) == 1 and len(lp.choices[0].logprobs.tokens) > 0
    assert served.all_blocks_free()


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        (C, {**P, "temperature": -1}, 400, "temperature", None),
        (C, {**P, "top_p": 0}, 400, "top_p", None),
        (C, {**P, "n": 0}, 400, "n", None),
        (C, {**P, "max_tokens": "x"}, 400, "max_tokens", None),
        (C, {**P, "max_tokens": 0}, 400, "max_tokens", None),
        (C, {**P, "stop": [""]}, 400, "stop", None),
        (C, {**P, "seed": -3}, 400, "seed", None),
        (C, {**P, "logprobs": 21}, 400, "logprobs", None),
        (C, {**P, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
        (C, {"model": "tiny-llama"}, 400, "prompt", None),
        (C, {**P, "prompt": [1, 2, 9999]}, 400, "prompt", "invalid_token_id"),
        (C, {**P, "prompt": [1, -2]}, 400, "prompt", "invalid_token_id"),
        (C, {**P, "prompt": [5] * 1024}, 400, "prompt", "context_length_exceeded"),
        (C, {**P, "max_tokens": 1023}, 400, "max_tokens", "context_length_exceeded"),
        (C, {**P, "model": "gpt-4"}, 404, "model", "model_not_found"),
        (CH, {**M, "max_completion_tokens": -1}, 400, "max_completion_tokens", None),
        (CH, {**M, "messages": []}, 400, "messages", None),
        (CH, {**M, "messages": [{"role": "wizard", "content": "a"}]}, 400, "messages[0].role", None),
        (CH, {**M, "messages": [{"role": "user", "content": "a " * 1100}]}, 400, "messages", "context_length_exceeded"),
        (CH, {**M, "model": "nope"}, 404, "model", "model_not_found"),
        (C, {**P, "presence_penalty": 2.5}, 400, "presence_penalty", None),
        (C, {**P, "frequency_penalty": "x"}, 400, "frequency_penalty", None),
        (CH, {**M, "repetition_penalty": 0}, 400, "repetition_penalty", None),
        (C, {**P, "logit_bias": {"9999": 1}}, 400, "logit_bias", "invalid_token_id"),
        (C, {**P, "logit_bias": {"w3": 1}}, 400, "logit_bias", None),
        (CH, {**M, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
        (CH, {**M, "logit_bias": [5]}, 400, "logit_bias", None),
        (C, {**P, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
        (C, {**P, "min_tokens": -1}, 400, "min_tokens", None),
        (CH, {**M, "response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format", None),
        (CH, {**M, "response_format": "json"}, 400, "response_format", None),
        (CH, {**M, "response_format": {"type": "json_object"}}, 400, "response_format", None),
        (CH, {**M, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400, "tools", None),
        (CH, {**M, "response_format": {"type": "json_object"}, "min_tokens": 2}, 400, "response_format", None),
        (C, {**P, "best_of": 1, "n": 2}, 400, "best_of", None),
        (C, {**P, "best_of": 0}, 400, "best_of", None),
        (C, {**P, "best_of": 3, "stream": True}, 400, "best_of", None),
        (C, {**P, "best_of": 3, "echo": True, "max_tokens": 0}, 400, "best_of", None),
    ],
)  # fmt: skip
def test_bad_requests_openai_shape(served, path, body, status, param, code):
    r = _post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert served.all_blocks_free()


def test_auth_json_and_route_errors(served):
    for key in (None, "wrong"):
        r = _post(served, C, P, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _post(served, C, None, raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    # the openai client maps them to its exceptions
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        _client(served).completions.create(model="other", prompt="a")
    with pytest.raises(openai.BadRequestError) as exc:
        _client(served).completions.create(model="tiny-llama", prompt="a", top_p=5)
    assert exc.value.body["param"] == "top_p"


def test_full_queue_answers_503(served):
    engine = served.engine
    saved = engine.max_live_requests
    engine.max_live_requests = 1
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.stream("POST", served.url + C, json=_long_body(True), headers=headers) as r:
            lines = r.iter_lines()
            next(lines)
            busy = _post(served, C, {**P, "max_tokens": 2})
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_error"
    finally:
        engine.max_live_requests = saved
    served.wait_idle()
    assert served.all_blocks_free()
    assert _post(served, C, {**P, "max_tokens": 2}).status_code == 200


def test_engine_step_failure_answers_500_and_loop_survives(served, monkeypatch):
    runner = served.llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def failing(step):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(step)

    monkeypatch.setattr(runner, "execute", failing)
    r = _post(served, C, {**P, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.setattr(runner, "execute", real)
    served.wait_idle()
    assert served.all_blocks_free()
    out = _client(served).completions.create(model="tiny-llama", prompt="a b", max_tokens=4, temperature=0)  # fmt: skip
    ref = _ref(served, [_enc(served, "a b")], SamplingParams(max_tokens=4))[0]
    assert out.choices[0].text == ref.text


def test_cli_serve_prints_address_and_serves(served, tmp_path):
    import subprocess
    import sys

    model_dir = served.model_dir
    cmd = [sys.executable, "-m", "kvplan", "serve", "--model", str(model_dir), "--port", "0",
           "--device", "cpu", "--block-size", "8", "--max-model-len", "64", "--num-blocks", "40"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "kvplan serve printed no address"
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 5, "temperature": 0})  # fmt: skip
        ref = _ref(served, [_enc(served, "a b c")], SamplingParams(max_tokens=5))[0]
        assert r.json()["choices"][0]["text"] == ref.text
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 64
    finally:
        proc.terminate()
        proc.wait(20)
