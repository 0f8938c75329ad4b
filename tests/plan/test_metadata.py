"""InputMetadata: flatten round trip, recursive_copy_, clean list, compute_attn_info, out=."""

import numpy as np
import pytest
import torch
from plan_cases import random_config, random_decode_batch, random_prompt_batch

from kvplan.ops.kv_ca_index import expand_kv_ca_index_decode_ref, expand_kv_ca_index_ref
from kvplan.ops.swa_index import expand_swa_index_decode_ref, expand_swa_index_ref
from kvplan.plan import InputMetadata, prepare_decode, prepare_prompt
from kvplan.plan.config import ratio_key


def _batch(seed, prompt):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng, dense_ratios=(2,), sparse_ratios=(2, 4), block_size=8)
    make = random_prompt_batch if prompt else random_decode_batch
    seqs = make(rng, cfg)
    return cfg, seqs, (prepare_prompt if prompt else prepare_decode)(seqs, cfg)


def _assert_same(a, b):
    fa, fb = a.to_flatten_dict(), b.to_flatten_dict()
    assert sorted(fa) == sorted(fb)
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


@pytest.mark.parametrize("prompt", [True, False])
def test_flatten_round_trip(prompt):
    _, _, meta = _batch(3, prompt)
    flat = meta.to_flatten_dict()
    assert "kv_ca_index_offset_len.2" in flat
    assert flat["klen"] == {} if prompt else "klen.4" in flat
    assert flat["kv_ca_index"] == {}  # empty dicts survive as values
    assert all(not isinstance(v, dict) or not v for v in flat.values())  # one level
    back = InputMetadata.from_flatten_dict(flat)
    _assert_same(meta, back)
    assert isinstance(back.kv_ca_index, dict) and back.kv_ca_index == {}


def test_compute_attn_info_matches_op_references_and_is_idempotent():
    cfg, _, meta = _batch(5, True)
    meta.compute_attn_info(cfg, check=True)
    piv = meta.kv_swa_full_index_pivots
    assert torch.equal(meta.kv_swa_full_index, expand_swa_index_ref(piv, cfg.window_size))
    ol = meta.kv_ca_index_offset_len["2"]
    assert torch.equal(meta.kv_ca_index["2"], expand_kv_ca_index_ref(ol, cfg.max_model_len // 2))
    assert torch.equal(meta.kv_ca_index_len["2"], ol[:, 1])
    for key in ("2", "4"):
        assert torch.equal(meta.klen[key], meta.ke[key] - meta.ks[key])
    first = meta.kv_swa_full_index
    meta.compute_attn_info(cfg)
    assert meta.kv_swa_full_index is first  # idempotent: nothing rebuilt
    assert set(meta.get_clean_list()) == {
        "kv_ca_index", "kv_ca_index_len", "kv_swa_index", "kv_swa_full_index", "klen"
    }  # fmt: skip
    meta.clean()
    assert meta.kv_swa_full_index is None and meta.kv_ca_index == {} and meta.klen == {}
    meta.compute_attn_info(cfg)
    assert torch.equal(meta.kv_swa_full_index, first)


def test_compute_attn_info_decode():
    cfg, _, meta = _batch(6, False)
    klen = meta.klen["4"]
    meta.compute_attn_info(cfg, check=True)
    assert "klen" not in meta.get_clean_list() and meta.klen["4"] is klen
    want = expand_swa_index_decode_ref(
        meta.kv_swa_index_offset_len, cfg.window_size, cfg.swa_block_size
    )
    assert torch.equal(meta.kv_swa_index, want)
    ol = meta.kv_ca_index_offset_len["2"]
    want = expand_kv_ca_index_decode_ref(
        ol, meta.block_tables.reshape(-1), cfg.block_size, 2, cfg.max_model_len // 2
    )
    assert torch.equal(meta.kv_ca_index["2"], want)
    meta.klen = {}
    meta.compute_attn_info(cfg)
    assert torch.equal(meta.klen["4"], klen)


def _capture_buffers(meta, rows):
    """Capture-size buffers shaped like every tensor field of ``meta``: ``rows`` rows, or as
    many as the field has when that is more (``cu_seqlens_*`` have one row per sequence + 1)."""

    def buf(v):
        return torch.full((max(rows, v.shape[0]), *v.shape[1:]), 77, dtype=v.dtype)

    out = {}
    for name, value in vars(meta).items():
        if isinstance(value, torch.Tensor):
            out[name] = buf(value)
        elif (
            isinstance(value, dict)
            and value
            and isinstance(next(iter(value.values())), torch.Tensor)
        ):
            out[name] = {k: buf(v) for k, v in value.items()}
    return out


def test_decode_out_buffers_written_in_place():
    cfg, seqs, ref = _batch(7, False)
    out = _capture_buffers(ref, 64)
    meta = prepare_decode(seqs, cfg, out=out)
    n_rows = meta.total_q
    assert meta.positions.data_ptr() == out["positions"].data_ptr()
    assert meta.klen["4"].data_ptr() == out["klen"]["4"].data_ptr()
    assert torch.equal(meta.positions, ref.positions)
    assert out["positions"][n_rows:].eq(77).all()  # rows past the step untouched
    # derived fields into capture buffers too
    derived = {
        "kv_swa_index": torch.full((64, cfg.window_size), 5, dtype=torch.int32),
        "kv_ca_index": {"2": torch.zeros(64, cfg.kv_ca_index_width(2), dtype=torch.int32)},
        "kv_ca_index_len": {"2": torch.zeros(64, dtype=torch.int32)},
    }
    meta.compute_attn_info(cfg, out=derived)
    ref.compute_attn_info(cfg)
    assert meta.kv_swa_index.data_ptr() == derived["kv_swa_index"].data_ptr()
    assert torch.equal(meta.kv_swa_index, ref.kv_swa_index)
    assert torch.equal(meta.kv_ca_index["2"], ref.kv_ca_index["2"])


@pytest.mark.parametrize(
    "break_it, match",
    [
        (lambda o: o.__setitem__("positions", o["positions"][:1]), "positions"),
        (lambda o: o.__setitem__("context_lens", o["context_lens"].long()), "context_lens"),
        (lambda o: o["klen"].pop("4"), "klen"),
        (lambda o: o.pop("block_tables"), "block_tables"),
        (
            lambda o: o.__setitem__("kv_swa_index_offset_len", o["kv_swa_index_offset_len"][:, :1]),
            "kv_swa_index_offset_len",
        ),  # fmt: skip
    ],
)
def test_bad_out_buffers_raise_before_writing(break_it, match):
    cfg, seqs, ref = _batch(7, False)
    out = _capture_buffers(ref, 64)
    break_it(out)
    before = {k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((ValueError, TypeError), match=match):
        prepare_decode(seqs, cfg, out=out)
    assert all(torch.equal(out[k], v) for k, v in before.items())  # nothing written


def test_recursive_copy():
    cfg, seqs, a = _batch(8, False)
    b = prepare_decode(seqs[::-1], cfg)
    target = prepare_decode(seqs[::-1], cfg, out=_capture_buffers(a, 64))
    target.total_q = 12345
    ptr = target.positions.data_ptr()
    target.recursive_copy_(b)
    assert target.positions.data_ptr() == ptr
    assert torch.equal(target.positions, b.positions)
    assert torch.equal(target.klen["2"], b.klen["2"])
    assert target.total_q == 12345  # scalars are not copied
    a.klen = {}
    with pytest.raises(ValueError, match="klen"):
        a.recursive_copy_(b)
    c = prepare_decode(seqs[::-1], cfg)
    c.positions = c.positions.long()
    with pytest.raises(TypeError, match="positions"):
        b.recursive_copy_(c)


def test_ratio_key():
    assert ratio_key(4) == "4"


def _decode_seqs(rng, cfg, n):
    from kvplan.plan import SequenceMetadata

    seqs = []
    for i in range(n):
        seqlen_k = int(rng.integers(1, cfg.max_model_len + 1))
        table = np.arange(1 + 40 * i, 1 + 40 * i + cfg.num_blocks_for(seqlen_k))
        seqs.append(SequenceMetadata(seqlen_q=1, seqlen_k=seqlen_k, block_table=table,
                                     state_id=i, token_ids=np.zeros(seqlen_k)))  # fmt: skip
    return seqs


def test_capture_size_buffers_then_smaller_batch_cpu():
    """CPU counterpart of the CUDA-graph test: the metadata views of a 16-row step are kept
    (as a captured graph keeps its addresses) and re-expanded after a 5-row step."""
    rng = np.random.default_rng(0)
    cfg = random_config(rng, dense_ratios=(2,), sparse_ratios=(2, 4), block_size=8,
                        max_ngram_size=0)  # fmt: skip
    big, small = _decode_seqs(rng, cfg, 16), _decode_seqs(rng, cfg, 5)
    bufs = _capture_buffers(prepare_decode(big, cfg), 16)
    derived = {
        "kv_swa_index": torch.empty(16, cfg.window_size, dtype=torch.int32),
        "kv_ca_index": {"2": torch.empty(16, cfg.kv_ca_index_width(2), dtype=torch.int32)},
        "kv_ca_index_len": {"2": torch.empty(16, dtype=torch.int32)},
    }
    captured = prepare_decode(big, cfg, out=bufs)
    captured.compute_attn_info(cfg, out=derived)
    prepare_decode(small, cfg, out=bufs)  # the smaller step writes the first rows in place
    captured.clean()
    captured.compute_attn_info(cfg, out=derived)  # "replay": same views, 16 rows
    ref = prepare_decode(small, cfg).compute_attn_info(cfg)
    assert torch.equal(derived["kv_swa_index"][:5], ref.kv_swa_index)
    assert torch.equal(derived["kv_ca_index"]["2"][:5], ref.kv_ca_index["2"])
    assert torch.equal(derived["kv_ca_index_len"]["2"][:5], ref.kv_ca_index_len["2"])


@pytest.mark.gpu
def test_cuda_graph_capture_then_replay_smaller_batch():
    """Capture metadata -> expansion at 16 rows; replay after a 5-row step written in place."""
    import dataclasses

    rng = np.random.default_rng(0)
    cpu_cfg = random_config(
        rng, dense_ratios=(2,), sparse_ratios=(2, 4), block_size=8, max_ngram_size=0
    )
    cfg = dataclasses.replace(cpu_cfg, device="cuda")
    big, small = _decode_seqs(rng, cfg, 16), _decode_seqs(rng, cfg, 5)
    template = prepare_decode(big, cpu_cfg)
    bufs = {k: (v.cuda() if isinstance(v, torch.Tensor) else {kk: vv.cuda() for kk, vv in v.items()})
            for k, v in _capture_buffers(template, 16).items()}  # fmt: skip
    derived = {
        "kv_swa_index": torch.empty(16, cfg.window_size, dtype=torch.int32, device="cuda"),
        "kv_ca_index": {
            "2": torch.empty(16, cfg.kv_ca_index_width(2), dtype=torch.int32, device="cuda")
        },  # fmt: skip
        "kv_ca_index_len": {"2": torch.empty(16, dtype=torch.int32, device="cuda")},
    }
    meta = prepare_decode(big, cfg, out=bufs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        meta.compute_attn_info(cfg, out=derived)
    torch.cuda.current_stream().wait_stream(stream)
    meta.clean()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta.compute_attn_info(cfg, out=derived)
    step = prepare_decode(small, cfg, out=bufs)  # writes the first 5 rows in place
    assert step.positions.data_ptr() == bufs["positions"].data_ptr()
    graph.replay()
    torch.cuda.synchronize()
    ref = prepare_decode(small, cpu_cfg).compute_attn_info(cpu_cfg)
    assert torch.equal(derived["kv_swa_index"][:5].cpu(), ref.kv_swa_index)
    assert torch.equal(derived["kv_ca_index"]["2"][:5].cpu(), ref.kv_ca_index["2"])
    assert torch.equal(derived["kv_ca_index_len"]["2"][:5].cpu(), ref.kv_ca_index_len["2"])


@pytest.mark.gpu
def test_gpu_builders_match_cpu():
    import dataclasses

    rng = np.random.default_rng(1)
    cpu_cfg = random_config(rng, dense_ratios=(2,), sparse_ratios=(2, 4), block_size=8)
    cfg = dataclasses.replace(cpu_cfg, device="cuda")
    for make, build in (
        (random_prompt_batch, prepare_prompt),
        (random_decode_batch, prepare_decode),
    ):
        seqs = make(rng, cpu_cfg)
        a = build(seqs, cfg).compute_attn_info(cfg, check=True)
        b = build(seqs, cpu_cfg).compute_attn_info(cpu_cfg, check=True)
        fa, fb = a.to_flatten_dict(), b.to_flatten_dict()
        for k, v in fb.items():
            if isinstance(v, torch.Tensor) and k != "block_tables":
                assert fa[k].is_cuda and torch.equal(fa[k].cpu(), v), k


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prompt", [True, False])
def test_out_path_equals_fresh_path(seed, prompt):
    """Writing prefixes of capture-size buffers gives the same fields as fresh tensors."""
    cfg, seqs, fresh = _batch(100 + seed, prompt)
    out = _capture_buffers(fresh, 4096)
    build = prepare_prompt if prompt else prepare_decode
    inplace = build(seqs, cfg, out=out)
    for name, value in fresh.to_flatten_dict().items():
        got = inplace.to_flatten_dict()[name]
        if isinstance(value, torch.Tensor) and name != "block_tables":
            assert got.data_ptr() == _capture_ptr(out, name) and torch.equal(got, value), name
        elif not isinstance(value, torch.Tensor):
            assert got == value, name


def _capture_ptr(out, path):
    name, _, key = path.partition(".")
    return (out[name][key] if key else out[name]).data_ptr()
