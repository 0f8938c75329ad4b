"""The README's Python examples run as written and do what their comments say (the front
door: a user's first copy-paste). Examples that need a server, several processes or the
packaged models are covered by their own tests (tests/server, tests/distributed,
tests/engine/test_smollm2.py, tests/engine/test_gemma3.py)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _example(first_import: str) -> str:
    found = [code for code in _examples() if first_import in code]
    assert len(found) == 1, f"README has {len(found)} examples with {first_import!r}"
    return found[0]


def test_readme_examples_are_found():
    assert len(_examples()) >= 5


def test_storage_example():
    ns: dict = {}
    exec(_example("    BlockLoadPlanBuilder,\n"), ns)
    cache, out, total_k = ns["cache"], ns["out"], ns["total_k"]
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (16, 64, 1, 528)
    assert total_k == 128 and out.dtype == torch.bfloat16 and tuple(out.shape) == (128, 512)
    assert (out[:28] == 0).all()  # "rows 0..27 are zeros"
    # the loaded rows are the stored ones, within fp8's rounding (e4m3: 2^-4 relative)
    kv = ns["kv"].float()
    err = (out[28:].float() - kv).abs() / kv.abs().amax(dim=1, keepdim=True)
    assert float(err.max()) < 2**-4


def test_planning_example():
    ns: dict = {}
    exec(_example("from kvplan.plan import MetadataConfig"), ns)
    meta = ns["meta"]
    assert meta.positions.shape[0] == 256  # one row per query token of the chunk
    assert int(meta.positions[0]) == 1000 - 256 and int(meta.positions[-1]) == 999
    from kvplan.plan.visibility import check_visibility

    check_visibility(meta, [ns["seq"]], ns["cfg"])  # the oracle of DESIGN.md's rules


def test_deepseek_v4_example(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the example saves "dsv4-tiny" in the working directory
    ns: dict = {}
    exec(_example("from transformers import DeepseekV4Config"), ns)
    (out,) = ns["out"]  # one request; the random model may sample its EOS before 8 tokens
    assert 1 <= len(out.token_ids) <= 8 and all(0 <= t < 128 for t in out.token_ids)
    assert out.finish_reason == ("length" if len(out.token_ids) == 8 else "stop")


def test_structured_output_example():
    """The schema example on the packaged SmolLM2 (greedy): the output is the schema's
    instance the comment shows."""
    import json

    ns: dict = {}
    exec(_example('"country": {"enum": ["France", "Spain", "Italy"]}'), ns)
    out = ns["out"]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert value == {"city": "Paris", "country": "France"}
