"""Tensor-parallel pieces that need no process group: the split rules and the sharding."""

import dataclasses

import pytest
import torch

from kvplan.backends import get_backend
from kvplan.distributed import TPContext, check_tensor_parallel, shard_state_dict
from kvplan.engine.config import EngineConfig
from kvplan.models.config import ModelConfig
from kvplan.models.llama import LlamaForCausalLM
from kvplan.models.weights import init_random_weights

CFG = ModelConfig(
    vocab_size=103, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim_override=8, qkv_bias=True, qk_norm=True,
)  # fmt: skip


def _full_state(cfg):
    model = LlamaForCausalLM(cfg, get_backend("vanilla"), max_positions=8)
    init_random_weights(model, seed=3)
    return model.state_dict()


def test_shards_reassemble_the_full_matrices():
    """Concatenating the ranks' shards along their split gives back every full tensor,
    head by head (q, k, v separately) and with the vocabulary padding dropped."""
    size, d = 2, CFG.head_dim
    full = _full_state(CFG)
    shards = [shard_state_dict(full, CFG, TPContext(r, size)) for r in range(size)]
    q, kv = CFG.num_heads * d, CFG.num_kv_heads * d
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert all(p.shape[0] == 52 for p in parts)  # ceil(103 / 2)
            torch.testing.assert_close(torch.cat(parts)[: CFG.vocab_size], t, rtol=0, atol=0)
            assert not parts[-1][CFG.vocab_size - 52 :].any()  # padding rows are zero
        elif "qkv_proj" in name:
            pieces = [torch.split(p, [q // size, kv // size, kv // size]) for p in parts]
            for j in range(3):
                got = torch.cat([pc[j] for pc in pieces])
                want = torch.split(t, [q, kv, kv])[j]
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        elif "gate_up_proj" in name:
            halves = [torch.chunk(p, 2) for p in parts]
            got = torch.cat([torch.cat([h[j] for h in halves]) for j in range(2)])
            torch.testing.assert_close(got, t, rtol=0, atol=0)
        elif "o_proj" in name or "down_proj" in name:
            torch.testing.assert_close(torch.cat(parts, dim=1), t, rtol=0, atol=0)
        else:
            for p in parts:
                torch.testing.assert_close(p, t, rtol=0, atol=0)


def test_shard_shapes_fit_the_rank_model():
    """A rank's shard loads (strictly) into the model built for that rank."""
    tp = TPContext(1, 2)
    with torch.device("meta"):
        model = LlamaForCausalLM(CFG, get_backend("vanilla"), max_positions=8, tp=tp)
    shard = shard_state_dict(_full_state(CFG), CFG, tp)
    for name, p in model.state_dict().items():
        assert tuple(shard[name].shape) == tuple(p.shape), name
    assert set(shard) == set(model.state_dict())


@pytest.mark.parametrize("size, kv", [(4, 2), (2, 1), (4, 1)])
def test_replicated_kv_heads(size, kv):
    """Fewer KV heads than ranks: rank r's k and v rows are those of KV head r // (size /
    kv), the head its query heads read; its q rows are its even share; the shard loads into
    the rank's model."""
    cfg = dataclasses.replace(CFG, num_heads=8, num_kv_heads=kv)
    d, q = cfg.head_dim, cfg.num_heads * cfg.head_dim
    full = _full_state(cfg)
    name = "layers.0.self_attn.qkv_proj.weight"
    fq, fk, fv = torch.split(full[name], [q, kv * d, kv * d])
    group = cfg.num_heads // kv  # query heads per KV head
    for r in range(size):
        tp = TPContext(r, size)
        head = r // (size // kv)
        assert tp.kv_head_range(kv) == (head, head + 1)
        shard = shard_state_dict(full, cfg, tp)
        sq, sk, sv = torch.split(shard[name], [q // size, d, d])
        assert torch.equal(sq, fq[r * q // size : (r + 1) * q // size])
        assert torch.equal(sk, fk[head * d : (head + 1) * d])
        assert torch.equal(sv, fv[head * d : (head + 1) * d])
        first_query_head = r * cfg.num_heads // size
        assert first_query_head // group == head  # the rank's queries read its KV head
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, get_backend("vanilla"), max_positions=8, tp=tp)
        assert {n: tuple(t.shape) for n, t in shard.items()} == {
            n: tuple(p.shape) for n, p in model.state_dict().items()
        }
    with pytest.raises(ValueError, match="num_kv_heads=3 or be a multiple"):
        TPContext(0, 2).kv_head_range(3)


def test_vocab_range_pads_the_last_rank():
    assert [TPContext(r, 3).vocab_range(10) for r in range(3)] == [
        (0, 4, 4),
        (4, 8, 4),
        (8, 10, 4),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 6, "num_kv_heads": 3}, "num_kv_heads=3"),
        ({"num_heads": 9, "num_kv_heads": 3}, "num_heads=9"),
        ({"intermediate_size": 63}, "intermediate_size=63"),
    ],
)
def test_indivisible_models_are_rejected(change, message):
    cfg = dataclasses.replace(CFG, **change)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 must divide .*{message}"):
        check_tensor_parallel(cfg, 2)
    check_tensor_parallel(cfg, 1)  # one rank takes anything


def test_engine_config_checks_tensor_parallel_size():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2.0)
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        EngineConfig(tensor_parallel_size=2, use_cuda_graph=True)
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_size == 2


def test_command_lines_take_the_flag():
    import argparse

    from kvplan.engine import cli_bench, cli_generate
    from kvplan.engine.config import config_from_args
    from kvplan.server import cli_serve

    for module in (cli_generate, cli_bench, cli_serve):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args, _ = parser.parse_known_args(["--tensor-parallel-size", "2", "p"])
        assert config_from_args(args).tensor_parallel_size == 2, module.__name__
