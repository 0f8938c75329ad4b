"""EngineConfig validation and sharing; the runner's attention-family hooks."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from kvplan import LLM, EngineConfig, SamplingParams
from kvplan.engine.config import add_engine_arguments, config_from_args
from kvplan.engine.step import StepBatch, token_positions
from kvplan.models.config import named_config

CFG = named_config("tiny-llama")


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("num_speculative_tokens", -1, ValueError),
        ("block_size", 0, ValueError),
        ("max_num_seqs", 0, ValueError),
        ("max_num_batched_tokens", 0, ValueError),
        ("max_model_len", 1, ValueError),
        ("num_blocks", 1, ValueError),
        ("kv_cache_memory", 0, ValueError),
        ("block_size", True, TypeError),
        ("max_num_seqs", 2.0, TypeError),
        ("seed", None, TypeError),
        ("enable_prefix_caching", 1, TypeError),
        ("use_cuda_graph", "yes", TypeError),
        ("backend", "flash", ValueError),
        ("kv_format", "int4", ValueError),
        ("dtype", "int8", ValueError),
        ("device", "nowhere", ValueError),
    ],
)
def test_validation_names_the_field_and_value(field, value, error):
    with pytest.raises(error, match=field) as info:
        EngineConfig(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_sampling_params_reject_bools_for_ints():
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=True)
    with pytest.raises(TypeError, match="top_k"):
        SamplingParams(top_k=False)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=True)


def test_resolved_values():
    c = EngineConfig(device="cpu")
    assert c.torch_device == torch.device("cpu") and c.torch_dtype == torch.float32
    assert not c.cuda_graphs_on and not c.async_scheduling_on
    assert c.resolve_kv_format(64) == "fp32" and c.resolve_max_model_len(2048) == 2048
    assert c.resolve_max_model_len(1 << 20) == 4096
    assert EngineConfig(max_model_len=100).resolve_max_model_len(50) == 100
    assert EngineConfig(dtype="bf16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="head_dim"):
        EngineConfig(kv_format="fp8").resolve_kv_format(48)
    with pytest.raises(ValueError, match="head_dim % 32"):
        EngineConfig(kv_format="int8").resolve_kv_format(48)
    assert EngineConfig(kv_format="int8").resolve_kv_format(64) == "int8"


def test_llm_kwargs_and_config_build_the_same_engine():
    kw = dict(device="cpu", backend="ragged", block_size=4, max_model_len=64, max_num_seqs=4)
    a = LLM(CFG, **kw)
    b = LLM(CFG, config=EngineConfig(**kw))
    c = LLM(CFG, EngineConfig(device="cpu", block_size=8), backend="ragged", block_size=4,
            max_model_len=64, max_num_seqs=4)  # fmt: skip
    assert a.config == b.config == c.config == a.parts.engine_config
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = [llm.generate([[1, 2, 3], [4, 5]], params) for llm in (a, b, c)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[2]]
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(CFG, no_such_setting=1)


def test_command_line_flags_map_onto_fields():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=None)  # a command's own flag, not the field
    add_engine_arguments(p, ("backend", "max_num_batched_tokens", "async_scheduling"),
                         max_num_batched_tokens=8192)  # fmt: skip
    args = p.parse_args(["--backend", "vanilla", "--async-scheduling", "off", "--seed", "3"])
    cfg = config_from_args(args, max_num_seqs=2)
    assert (cfg.backend, cfg.max_num_batched_tokens, cfg.async_scheduling) == (
        "vanilla", 8192, False,
    )  # fmt: skip
    assert cfg.max_num_seqs == 2 and cfg.seed == EngineConfig().seed
    with pytest.raises(SystemExit):
        p.parse_args(["--backend", "flash"])


def test_a_command_default_is_named_in_its_help():
    """A command that overrides a field's default says so in the flag's help; an optional
    bool's default shows as on / off and parses into the config."""
    p = argparse.ArgumentParser()
    add_engine_arguments(p, ("warmup", "max_num_batched_tokens", "backend"), warmup=False,
                         max_num_batched_tokens=8192)  # fmt: skip
    helps = {a.dest: a.help for a in p._actions}
    assert helps["warmup"].endswith("this command's default: off")
    assert helps["max_num_batched_tokens"].endswith("this command's default: 8192")
    assert "this command's default" not in helps["backend"]
    assert config_from_args(p.parse_args([])).warmup is False
    assert config_from_args(p.parse_args(["--warmup", "on"])).warmup is True


def test_token_positions_match_a_per_row_loop():
    rng = np.random.default_rng(0)
    cached = rng.integers(0, 50, 7).astype(np.int32)
    query = rng.integers(1, 6, 7).astype(np.int32)
    want = [p for c, q in zip(cached, query) for p in range(c, c + q)]
    assert token_positions(cached, query).tolist() == want


class ProbeFamily:
    """A second attention family that no layer uses: records what the runner asks of it."""

    name = "probe"

    def __init__(self):
        self.steps: list[StepBatch] = []
        self.freed: list[int] = []

    def plan(self, step):
        self.steps.append(step)
        return ("probe plan", len(self.steps))

    def free(self, request_id):
        self.freed.append(request_id)


def test_every_family_is_planned_once_per_step_and_told_of_frees():
    llm = LLM(CFG, device="cpu", block_size=4, max_model_len=64, max_num_seqs=4)
    probe = ProbeFamily()
    runner = llm.engine.runner
    runner.families[probe.name] = probe
    seen = []
    model = runner.model

    def spy(input_ids, positions, attention, rows):
        seen.append(dict(attention))
        return model(input_ids, positions, attention, rows)

    runner.model = spy
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 5)]
    outs = llm.generate([[1, 2, 3, 4, 5], [6, 7]], params)
    assert len(probe.steps) == len(seen) == llm.engine.num_steps
    assert all(a["probe"] == ("probe plan", i + 1) for i, a in enumerate(seen))
    assert all(a["paged"] is runner.metadata for a in seen)
    first = probe.steps[0]
    assert first.request_ids == [o.request_id for o in outs] and first.num_contexts == 2
    assert first.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert sorted(probe.freed) == sorted(o.request_id for o in outs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.num_contexts = 0
