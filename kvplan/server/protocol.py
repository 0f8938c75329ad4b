"""OpenAI request bodies -> token ids and `SamplingParams`; the OpenAI error shape.

`parse_completion` and `parse_chat` check every field they read and raise `ApiError` (HTTP
400, naming the parameter) for a bad one, so nothing invalid reaches the engine. Fields the
engine cannot honour (``suffix``, ``tool_choice: "auto"``) are refused with a 400 naming
them unless they hold their neutral value; unknown fields are ignored. Structured output:
``response_format`` (`_json_mode`) and forced tool calls (`parse_tools`). ``presence_penalty`` /
``frequency_penalty`` (in [-2, 2]), ``logit_bias`` (token id strings to [-100, 100]) and
vLLM's ``repetition_penalty`` (> 0) and ``min_tokens`` go to `SamplingParams`.

Logprobs: chat ``logprobs: true`` with ``top_logprobs: k``; completions ``logprobs: k`` and
``echo: true`` (the prompt's own logprobs, as evaluation harnesses use for log-likelihoods;
``max_tokens: 0`` with ``echo`` scores the prompt without generating). ``k <= 20``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kvplan.engine.json_schema import JsonSchema
from kvplan.engine.logprobs import MAX_LOGPROBS
from kvplan.engine.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SamplingParams

MAX_N = 16  # most choices per prompt


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ModelLimits:
    """What requests are checked against: the served name, ``max_model_len`` and a
    ``check_prompt(ids) -> ids`` that raises ValueError/TypeError for ids outside the
    vocabulary."""

    name: str
    max_model_len: int
    check_prompt: Any


@dataclass
class Parsed:
    """A validated request: one entry of ``prompts`` / ``params`` per generated sequence
    (prompt ``i``'s are entries ``i * k .. i * k + k - 1``, ``k = per_prompt``: ``n``, or
    ``best_of`` when the server generates more than it returns)."""

    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    num_prompts: int
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top-k alternatives to report per token (None: no logprobs)
    echo: bool = False  # completions: the prompt (and its logprobs) precede the completion
    score_only: bool = False  # max_tokens=0 with echo: the one generated token is dropped
    best_of: int | None = None  # completions: sequences generated per prompt, the n best kept
    tool_call: bool = False  # chat: the output is one forced tool call (`parse_tools`)
    tool_names: tuple[str, ...] = ()  # chat, tool_choice auto: calls parsed from the text

    @property
    def per_prompt(self) -> int:
        """Sequences generated per prompt (entries of ``prompts`` / ``params`` each)."""
        return self.best_of or self.n


# ---------------------------------------------------------------- field checks
def _int(body: dict, name: str, default: Any, minimum: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise bad(name, f"{name} must be >= {minimum}, got {v}")
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        side = "(" if lo_open else "["
        raise bad(name, f"{name} must be in {side}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be a boolean, got {v!r}")
    return v


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or any(not isinstance(s, str) or not s for s in v):
        raise bad("stop", f"stop must be a non-empty string or a list of them, got {v!r}")
    return tuple(v) or None


def _token_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise bad(name, f"{name} must be a list of integers, got {v!r}")
    return v


def _refuse_unsupported(body: dict, neutral: dict[str, Any]) -> None:
    for name, ok in neutral.items():
        v = body.get(name)
        if v is not None and v != ok and not (isinstance(ok, tuple) and v in ok):
            raise bad(name, f"{name}={v!r} is not supported by this server")


def _json_mode(body: dict) -> bool | JsonSchema:
    """``response_format``: ``{"type": "json_object"}`` turns on JSON mode (the completion is
    one JSON object, `SamplingParams.json_mode`; whether the model's tokenizer can run it is
    the engine's check, `EngineCore.json_vocab`); ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}`` constrains it to the schema (`SamplingParams.json_schema`,
    returned compiled; an unsupported schema names its path); ``{"type": "text"}`` or none
    leaves it off."""
    v = body.get("response_format")
    if v is None:
        return False
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return False
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("response_format", "response_format.json_schema must be an object with "
                      "a 'schema' object")  # fmt: skip
        try:
            return JsonSchema(spec["schema"], where="response_format.json_schema.schema")
        except ValueError as exc:
            raise bad("response_format", str(exc)) from None
    if kind != "json_object":
        raise bad("response_format", f"response_format={v!r} is not supported by this server "
                  "(only types 'json_object', 'json_schema' or 'text')")  # fmt: skip
    return True


def _logit_bias(body: dict, limits: ModelLimits) -> dict[int, float] | None:
    """``logit_bias``: a JSON object of token ids (as strings, OpenAI's form, or integers)
    to biases in [-100, 100], each id checked against the vocabulary."""
    v = body.get("logit_bias")
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", f"logit_bias must be an object of token id to bias, got {v!r}")
    out: dict[int, float] = {}
    for key, value in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"logit_bias: {key!r} is not a token id") from None
        try:
            limits.check_prompt([token])
        except (ValueError, TypeError) as exc:
            raise bad("logit_bias", f"logit_bias: {exc}", code="invalid_token_id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            raise bad(
                "logit_bias",
                f"logit_bias[{key!r}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value!r}",
            )
        out[token] = float(value)
    return out


def _check_model(body: dict, limits: ModelLimits) -> str:
    model = body.get("model", limits.name)
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, got {model!r}")
    if model != limits.name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {limits.name!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _sampling(
    body: dict,
    limits: ModelLimits,
    prompts: list[list[int]],
    prompt_param: str,
    max_tokens_names: tuple[str, ...],
    default_max_tokens: int | None,
    logprobs: int | None = None,
    echo: bool = False,
    best_of_ok: bool = False,
    json_mode: bool | JsonSchema = False,
) -> Parsed:
    """The fields every endpoint shares; ``prompts`` are token ids, not yet checked.
    ``logprobs``: top-k per generated token (and per prompt token with ``echo``);
    ``best_of_ok``: the endpoint takes ``best_of`` (`_best_of`)."""
    model = _check_model(body, limits)
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad(prompt_param, f"{prompt_param} is empty (no tokens)")
        try:
            prompts[i] = limits.check_prompt(ids)
        except (ValueError, TypeError) as exc:
            raise bad(prompt_param, f"{prompt_param}: {exc}", code="invalid_token_id") from None
    max_tokens, mt_name = None, max_tokens_names[0]
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens, mt_name = _int(body, name, None, 0 if echo else 1), name
            break
    score_only = max_tokens == 0  # echo only: generate one token, report none
    limit = limits.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise bad(
            prompt_param,
            f"the prompt has {longest} tokens; this model's limit is {limit} tokens "
            "(prompt + completion)",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        room = limit - longest
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif score_only:
        max_tokens = 1
    elif longest + max_tokens > limit:
        raise bad(
            mt_name,
            f"{mt_name}={max_tokens} plus the prompt's {longest} tokens exceeds this model's "
            f"limit of {limit} tokens",
            code="context_length_exceeded",
        )
    n = _int(body, "n", 1, 1)
    if n > MAX_N:
        raise bad("n", f"n must be <= {MAX_N}, got {n}")
    best_of = _best_of(body, n, echo) if best_of_ok else None
    # with best_of the sampled tokens' logprobs rank the sequences (reported only if asked)
    logprobs_gen = 0 if best_of is not None and logprobs is None else logprobs
    seed = _int(body, "seed", None, 0)
    if seed is not None and seed >= 2**63 - MAX_N:
        raise bad("seed", f"seed must be < 2**63 - {MAX_N}, got {seed}")
    top_k = _int(body, "top_k", 0, -1)
    min_tokens = 0 if score_only else _int(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}")
    stop_ids = body.get("stop_token_ids")
    stop_ids = () if stop_ids is None else tuple(_token_list(stop_ids, "stop_token_ids"))
    if any(t < 0 for t in stop_ids):
        raise bad("stop_token_ids", f"stop_token_ids must be >= 0, got {list(stop_ids)}")
    base = dict(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0, False),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, True),
        top_k=top_k,
        stop=_stop(body),
        stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs_gen,
        prompt_logprobs=logprobs if echo else None,
        presence_penalty=_float(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, False),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, False),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, math.inf, True),
        logit_bias=_logit_bias(body, limits),
        min_tokens=min_tokens,
        json_mode=bool(json_mode),
        json_schema=json_mode if isinstance(json_mode, JsonSchema) else None,
    )
    if json_mode and (base["ignore_eos"] or min_tokens):
        raise bad("response_format", "json_object ends with EOS after the object: it cannot "
                  "take ignore_eos or min_tokens")  # fmt: skip
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", f"stream_options must be an object, got {opts!r}")
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream=true")
        include_usage = _bool(opts, "include_usage", False)
    if best_of is not None and stream:
        raise bad("best_of", "best_of greater than n cannot be streamed")
    all_prompts, params = [], []
    for ids in prompts:
        for j in range(best_of or n):
            # choice j of a seeded request draws from seed + j: reproducible, yet distinct
            params.append(SamplingParams(**base, seed=None if seed is None else seed + j))
            all_prompts.append(ids)
    return Parsed(
        model, all_prompts, params, len(prompts), n, stream, include_usage, logprobs, echo,
        score_only, best_of,
    )  # fmt: skip


def _best_of(body: dict, n: int, echo: bool) -> int | None:
    """Completions' ``best_of``: sequences generated per prompt, of which the ``n`` with the
    highest log-probability per token are returned. None when it is absent or equals
    ``n`` (nothing to choose)."""
    best_of = _int(body, "best_of", None, 1)
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise bad("best_of", f"best_of must be >= n, got best_of={best_of} and n={n}")
    if best_of > MAX_N:
        raise bad("best_of", f"best_of must be <= {MAX_N}, got {best_of}")
    if echo and body.get("max_tokens") == 0:
        raise bad("best_of", "best_of needs generated tokens (max_tokens=0 only scores)")
    return best_of


def _top_k(body: dict, name: str) -> int | None:
    k = _int(body, name, None, 0)
    if k is not None and k > MAX_LOGPROBS:
        raise bad(name, f"{name} must be <= {MAX_LOGPROBS}, got {k}")
    return k


# ---------------------------------------------------------------- endpoints
def parse_completion(body: Any, tokenizer: Any, limits: ModelLimits) -> Parsed:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of
    either (one prompt each). Strings are tokenized as the tokenizer does (BOS included)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _refuse_unsupported(body, {"suffix": ("",)})
    logprobs = _top_k(body, "logprobs")
    echo = _bool(body, "echo", False)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "prompt is required")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", f"prompt must be a string, a list of token ids or a list of those, got {prompt!r}")  # fmt: skip
    prompts: list[list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad("prompt", "this model has no tokenizer: send token ids")
            prompts.append([int(t) for t in tokenizer.encode(p)])
        else:
            prompts.append(list(_token_list(p, "prompt")))
    return _sampling(body, limits, prompts, "prompt", ("max_tokens",), 16, logprobs, echo,
                     best_of_ok=True, json_mode=_json_mode(body))  # fmt: skip


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content", "a text part needs a string 'text'")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"content must be a string or a list of text parts, got {content!r}")  # fmt: skip


_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


TOOL_CALL_OPEN = "<tool_call>"  # a Hermes-style template's call: the block's start
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes_tool_calls(text: str, names: tuple[str, ...]) -> tuple[str, list[dict]]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a free
    answer (the syntax of Hermes-style chat templates, e.g. Qwen2.5 / Qwen3): (the text
    outside the blocks, stripped; the calls as ``{"name", "arguments"}`` with the arguments'
    JSON text). A block that is not such JSON, or names no tool of ``names``, stays text."""
    calls, kept, last = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if (
            not isinstance(call, dict)
            or call.get("name") not in names
            or not isinstance(call.get("arguments", {}), dict)
        ):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        args = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append({"name": call["name"], "arguments": args})
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def parse_tools(
    body: dict, template: str = ""
) -> tuple[list[dict] | None, JsonSchema | None, tuple[str, ...]]:
    """``tools`` / ``tool_choice`` of a chat body: (the tools for the chat template, or None;
    the recognizer of the forced call, or None).

    ``tool_choice`` ``"required"`` forces a call of one of the tools, ``{"type": "function",
    "function": {"name": N}}`` a call of N: the output is constrained to ``{"name": ...,
    "arguments": ...}`` with the arguments an instance of the tool's ``parameters`` (the
    structured-output subset, `JsonSchema.tool_call`) and answered as ``tool_calls``.
    ``"none"`` only shows the tools to the template. ``"auto"`` (the default with tools)
    lets the model answer freely; it needs a chat template ``template`` that writes calls as
    ``<tool_call>`` blocks (`hermes_tool_calls` parses them; the third element: the tool
    names) and is refused for others, whose call syntax this server does not parse."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"tool_choice={choice!r} needs tools")
        return None, None, ()
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list, got {tools!r}")
    specs = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", "a tool must be {'type': 'function', 'function': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name", f"a function name must match "
                      f"[A-Za-z0-9_-]{{1,64}}, got {name!r}")  # fmt: skip
        params = fn.get("parameters", {"type": "object", "properties": {}})
        specs.append((name, params))
    if choice is None or choice == "auto":
        if TOOL_CALL_OPEN not in (template or ""):
            raise bad("tool_choice", "tool_choice 'auto' needs a chat template that writes "
                      "<tool_call> blocks; this model's does not (use tool_choice 'required' "
                      "or {'type': 'function', 'function': {'name': ...}}, or 'none')")  # fmt: skip
        return tools, None, tuple(n for n, _ in specs)
    if choice == "none":
        return tools, None, ()
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in [n for n, _ in specs]:
            raise bad("tool_choice", f"tool_choice={choice!r} must name a function of tools")
        specs = [sp for sp in specs if sp[0] == name]
    elif choice != "required":
        raise bad("tool_choice", f"tool_choice={choice!r} is not supported")
    try:
        return tools, JsonSchema.tool_call(specs), ()
    except ValueError as exc:
        raise bad("tools", str(exc)) from None


def parse_chat(body: Any, tokenizer: Any, limits: ModelLimits) -> Parsed:
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template
    (with the generation prompt); ``max_completion_tokens`` or ``max_tokens`` (default: up to
    the model's limit)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    tools, call, names = parse_tools(body, str(getattr(tokenizer, "chat_template", None) or ""))
    json_mode = _json_mode(body)
    if call is not None:
        if json_mode:
            raise bad("response_format", "response_format cannot be combined with a forced "
                      "tool call")  # fmt: skip
        json_mode = call
    top = _top_k(body, "top_logprobs")
    if _bool(body, "logprobs", False):
        logprobs = 0 if top is None else top
    elif top:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    else:
        logprobs = None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {messages!r}")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"a message must be an object, got {m!r}")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {_ROLES}, got {role!r}")
        calls = m.get("tool_calls")
        content = m.get("content")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise bad(f"messages[{i}].tool_calls", "tool_calls must be a list on an assistant "
                      "message")  # fmt: skip
        entry = {"role": role, "content": "" if content is None and calls else
                 _message_text(content, i)}  # fmt: skip
        if calls:
            entry["tool_calls"] = calls
        if role == "tool" and "tool_call_id" in m:
            entry["tool_call_id"] = m["tool_call_id"]
        conv.append(entry)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad(None, "this model has no chat template: use /v1/completions")
    try:
        extra = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                            **extra)  # fmt: skip
    except Exception as exc:  # the template's own checks (e.g. role order)
        raise bad("messages", f"the chat template rejected the messages: {exc}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    parsed = _sampling(
        body, limits, [[int(t) for t in ids]], "messages", ("max_completion_tokens", "max_tokens"), None,
        logprobs, json_mode=json_mode,
    )  # fmt: skip
    parsed.tool_call = call is not None
    parsed.tool_names = names
    return parsed
