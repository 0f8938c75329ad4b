"""JSON mode: the byte recognizer against Python's ``json`` (every prefix of a valid object
accepted, whole texts accepted exactly when ``json.loads`` gives an object), the trie's masks
against a per-token brute force, token bytes against the tokenizer's own decoding, and the
engine: guided completions of a random-weight model are JSON object prefixes, and those that
end on EOS parse as objects."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from kvplan.engine.json_mode import TokenTrie, complete, start_state, step, token_bytes
from kvplan.engine.sampling import SamplingParams

DOCS = [
    "{}",
    '{"a":1}',
    '{ "a" : [1, -2.5e+3, 0, 0.25, 1E2, true, false, null, {}, []] }',
    '{"k\\u00e9y":"v\\n\\"q\\"\\\\","n":{"m":[[],[{}]]}}',
    '{"\xc3\xa9t\xc3\xa9":"\xe2\x82\xac"}',
    '{\n\t"x":\r\n-0}',
]


def _run(text: bytes):
    """The state after ``text``, or None where a byte is rejected."""
    st = start_state()
    for b in text:
        st = step(st, b)
        if st is None:
            return None
    return st


def _reference_object(text: str) -> bool:
    """Python's json: one object, no surrounding whitespace, no NaN / Infinity."""
    if text != text.strip():
        return False

    def no_constants(name):
        raise ValueError(name)

    try:
        return isinstance(json.loads(text, parse_constant=no_constants), dict)
    except (ValueError, RecursionError):
        return False


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -3, 17, 2.5, -1e-7, 3e21])
    if kind in (2, 3):
        return "".join(rng.choice('ab"\\/\n\t\u00e9\u20ac\x01 ') for _ in range(rng.randrange(6)))
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_random_value(rng, 3) if False else f"k{i}": _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}  # fmt: skip


def random_edit(text: str, rng: random.Random, alphabet, edits: int) -> str:
    """``text`` with ``edits`` random edits: a character deleted, or one of ``alphabet``'s
    pieces inserted or put in a character's place."""
    s = list(text)
    for _ in range(edits):
        i = rng.randrange(len(s) + 1)
        op = rng.randrange(3)
        if op == 0 and i < len(s):
            del s[i]
        elif op == 1:
            s.insert(i, rng.choice(alphabet))
        elif i < len(s):
            s[i] = rng.choice(alphabet)
    return "".join(s)


def _random_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        obj = {f"k{i}": _random_value(rng, 1) for i in range(rng.randrange(4))}
        indent = rng.choice([None, 1, "\t"])
        docs.append(json.dumps(obj, indent=indent, ensure_ascii=rng.random() < 0.5))
    return docs


@pytest.mark.parametrize("doc", DOCS + _random_docs(40, 0))
def test_every_prefix_of_an_object_is_accepted(doc):
    data = doc.encode("utf-8") if not doc.startswith('{"\xc3') else doc.encode("latin-1")
    st = start_state()
    for i, b in enumerate(data):
        assert not complete(st), f"complete before byte {i}"
        st = step(st, b)
        assert st is not None, f"byte {i} ({bytes([b])!r}) of {data!r} rejected"
    assert complete(st)


def test_whole_texts_agree_with_json_loads():
    """Random edits of valid objects (a byte deleted, inserted or replaced): accepted and
    complete exactly when ``json.loads`` gives an object."""
    rng = random.Random(1)
    alphabet = '{}[],:"\\ 0123456789-+.eEtrufalsn\x01x'
    checked = {True: 0, False: 0}
    for doc in _random_docs(60, 2) + DOCS[:4]:
        for _ in range(25):
            text = random_edit(doc, rng, alphabet, 1)
            want = _reference_object(text)
            st = _run(text.encode("utf-8"))
            assert (st is not None and complete(st)) == want, text
            checked[want] += 1
    assert checked[True] > 50 and checked[False] > 500


def test_trie_masks_equal_brute_force():
    rng = random.Random(3)
    alphabet = b'{}[],:"\\ 0123456789-.eEtrufalsnxy\n\x05\xc3\xa9'
    pieces = [None, b"{", b"}", b'"', b'{"', b'":', b'"}', b"true", b"tr", b" ", b"\\u00"]
    pieces += [bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
               for _ in range(600)]  # fmt: skip
    trie = TokenTrie(pieces)
    states = {start_state()}
    for doc in _random_docs(25, 4) + DOCS:
        st = start_state()
        for b in doc.encode("utf-8"):
            st = step(st, b)
            states.add(st)
    assert len(states) > 40
    for st in states:
        want = np.zeros(len(pieces), dtype=bool)
        for tid, piece in enumerate(pieces):
            cur = st
            for b in piece or b"":
                cur = None if cur is None else step(cur, b)
            want[tid] = piece is not None and cur is not None
        got = trie.allowed(st)
        assert np.array_equal(got, want), st
        assert trie.allowed(st) is got  # memoized


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer trained here on a few JSON texts (every byte has a token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_random_docs(200, 5) + DOCS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_token_bytes_match_the_tokenizer():
    tok = _byte_level_tokenizer()
    pieces = token_bytes(tok)
    assert pieces[tok.eos_token_id] is None and pieces[tok.bos_token_id] is None
    for text in ['{"caf\u00e9": [1, 2]}', "  x\n\ty \u20ac"] + _random_docs(10, 6):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")


def make_json_model_folder(folder, seed: int = 0):
    """A random tiny Llama over `_byte_level_tokenizer` written into ``folder``."""
    import transformers as tf

    tok = _byte_level_tokenizer()
    cfg = tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def json_llm(tmp_path_factory):
    from kvplan import LLM

    folder = make_json_model_folder(tmp_path_factory.mktemp("json_llama"))
    return LLM(str(folder), device="cpu")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_are_json_objects(json_llm, async_scheduling):
    """Sampled and greedy guided completions (mixed with an unguided row): every output's
    bytes are a JSON object prefix; those that stopped on EOS parse as objects; the unguided
    row equals its run alone."""
    llm = json_llm
    finished = 0
    for out, data in guided_outputs(llm, async_scheduling, 120, json_mode=True):
        st = _run(data)
        assert st is not None, data
        if out.finish_reason == "stop":
            assert complete(st) and out.token_ids[-1] == llm.tokenizer.eos_token_id
            assert isinstance(json.loads(data.decode("utf-8")), dict)
            assert isinstance(json.loads(out.text), dict)
            finished += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 120
    assert finished >= 2


def guided_outputs(llm, async_scheduling: bool, max_tokens: int, **guide) -> list:
    """Six guided completions (greedy and sampled) generated beside an unguided row, which
    must equal its run alone; ``[(output, its bytes)]`` of the guided ones."""
    llm.engine.async_scheduling = async_scheduling
    pieces = token_bytes(llm.tokenizer)
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=s, **guide)
              for t, s in [(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3), (1.3, 4), (1.0, 5)]]  # fmt: skip
    plain = SamplingParams(max_tokens=20, temperature=1.0, seed=9)
    outs = llm.generate(["say", "hi", "a", "b", "c", "d", "e"], params + [plain])
    assert outs[-1].token_ids == llm.generate(["e"], [plain])[0].token_ids
    return [(o, b"".join(pieces[t] for t in o.token_ids if pieces[t] is not None))
            for o in outs[:-1]]  # fmt: skip


def test_json_mode_param_checks():
    with pytest.raises(TypeError, match="json_mode"):
        SamplingParams(json_mode=1)
    for bad in (dict(ignore_eos=True), dict(min_tokens=2)):
        with pytest.raises(ValueError, match="json_mode"):
            SamplingParams(json_mode=True, **bad)
    assert SamplingParams(json_mode=True).adjusts_logits
    assert not SamplingParams(json_mode=True).greedy


def test_strings_take_well_formed_utf8_only():
    """Random byte runs inside a string: accepted exactly when Python decodes them."""
    rng = random.Random(8)
    pool = [0x41, 0x80, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5]
    agree = {True: 0, False: 0}
    for _ in range(3000):
        run = bytes(rng.choice(pool) for _ in range(rng.randrange(1, 5)))
        try:
            run.decode("utf-8")
            want = True
        except UnicodeDecodeError:
            want = False
        st = _run(b'{"k":"' + run + b'"}')
        assert (st is not None and complete(st)) == want, run
        agree[want] += 1
    assert agree[True] > 50 and agree[False] > 1000


@pytest.mark.gpu
def test_cuda_engine_outputs_are_json_objects(tmp_path):
    """On CUDA (graphs and async scheduling on by default): the greedy guided output equals
    the CPU engine's token for token (fp32); every output is a JSON object prefix and the
    finished ones parse as objects (sampled rows draw from the device's generator)."""
    from kvplan import LLM

    folder = make_json_model_folder(tmp_path / "m")
    params = [SamplingParams(max_tokens=80, temperature=0.0, json_mode=True)] + [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, json_mode=True) for s in (1, 2, 3)
    ]
    prompts = ["say", "hi", "a", "b"]
    llm = LLM(str(folder), device="cuda", dtype="float32")
    gpu = llm.generate(prompts, params)
    cpu = LLM(str(folder), device="cpu").generate(prompts[:1], params[:1])
    assert gpu[0].token_ids == cpu[0].token_ids
    pieces = token_bytes(llm.tokenizer)
    for o in gpu:
        st = _run(b"".join(pieces[t] for t in o.token_ids if pieces[t] is not None))
        assert st is not None
        if o.finish_reason == "stop":
            assert complete(st) and isinstance(json.loads(o.text), dict)
