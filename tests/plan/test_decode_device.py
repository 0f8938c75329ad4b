"""prepare_decode_on_device equals the eager prepare_decode field by field.

CPU: torch path and the Triton kernels under the interpreter (tiny batches). GPU (marked):
the kernels on CUDA, and a CUDA graph captured at a large batch and replayed with a smaller
one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_cases import random_config
from plan_cases import random_decode_batch as plan_cases_decode_batch
from sm90_compile import compile_sm90

from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode import prepare_decode
from kvplan.plan.decode_buffers import make_decode_device_out, stack_rows
from kvplan.plan.decode_device import prepare_decode_on_device
from kvplan.plan.sequence import SequenceMetadata

PER_TOKEN = (
    "positions", "input_ids", "gate_force_random", "valid_token_mask", "query_indices",
    "state_block_idx", "slot_mapping_store_swa", "context_lens", "kv_swa_index_offset_len",
    "ngram_token_ids",
)  # fmt: skip
PER_SEQ = ("seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
PER_RATIO = ("positions_c", "slot_mapping_store_ca", "klen", "kv_ca_index_offset_len")
SCALARS = ("is_prompt", "num_seqs", "total_q", "max_seqlen_q", "max_seqlen_k")
# Triton paths run on the GPU when there is one, else in the interpreter (tests/conftest.py).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_config(device="cpu", **kw) -> MetadataConfig:
    base = dict(
        block_size=16, dense_ratios=(4, 16), sparse_ratios=(4, 8), window_size=8,
        swa_block_size=12, max_model_len=512, max_num_blocks=40, num_kv_blocks=64,
        num_state_slots=16, force_load_balance=True, device=device,
    )  # fmt: skip
    base.update(kw)
    return MetadataConfig(**base)


def random_decode_batch(rng, cfg: MetadataConfig, n_seq: int, max_draft: int = 2):
    seqs = []
    for _ in range(n_seq):
        n_draft = int(rng.integers(0, max_draft + 1))
        sq = 1 + n_draft
        sk = int(rng.integers(sq, cfg.max_model_len + 1))
        q_start = sk - sq
        nb = cfg.num_blocks_for(sk)
        table = rng.integers(0, cfg.num_kv_blocks, nb + int(rng.integers(0, 3)))
        seqs.append(
            SequenceMetadata(
                seqlen_q=sq,
                seqlen_k=sk,
                block_table=table,
                state_id=int(rng.integers(0, cfg.num_state_slots)),
                token_ids=rng.integers(0, 1000, q_start + 1).tolist(),
                is_placeholder=bool(rng.random() < 0.2),
                swa_valid_start=int(rng.integers(0, q_start + 1)) if rng.random() < 0.4 else 0,
                draft_tokens=rng.integers(0, 1000, n_draft).tolist(),
            )
        )
    return seqs


def add_engram_ids(seqs) -> None:
    """Give every sequence known compressed ids (first half) and a lookup table (vocab 50)."""
    for s in seqs:
        s.compressed_token_ids = [t % 50 for t in s.token_ids[: len(s.token_ids) // 2]]
        s.lookup_table = np.arange(1000) % 50


def assert_same_decode(got, want, cfg: MetadataConfig):
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name
    for name in PER_TOKEN + PER_SEQ:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu()), name
    for name in PER_RATIO:
        a, b = getattr(got, name), getattr(want, name)
        assert a.keys() == b.keys(), name
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (name, k)
            assert torch.equal(a[k].cpu(), b[k].cpu()), (name, k)
    # block_tables: only each row's first num_blocks columns are defined
    bt_a, bt_b = got.block_tables.cpu(), want.block_tables.cpu()
    assert bt_a.shape == bt_b.shape and bt_a.dtype == bt_b.dtype
    min_ratio, tpb = cfg.min_ratio, cfg.tokens_per_block(cfg.min_ratio)
    ends = (want.seqlens_k.cpu().long() // min_ratio + tpb - 1) // tpb  # num_blocks_for
    rows = torch.repeat_interleave(ends, want.seqlens_q.cpu().long())
    cols = torch.arange(bt_a.shape[1])
    defined = cols[None, :] < rows[:, None]
    assert torch.equal(bt_a[defined], bt_b[defined])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_torch_path_equals_eager(seed):
    rng = np.random.default_rng(seed)
    cfg = make_config(max_ngram_size=2 if seed % 2 else 0)
    seqs = random_decode_batch(rng, cfg, int(rng.integers(1, 12)))
    if cfg.max_ngram_size:
        add_engram_ids(seqs)
    else:  # tables exactly as long as needed (the host path's no-gather case)
        for s in seqs:
            s.block_table = s.block_table[: cfg.num_blocks_for(s.seqlen_k)]
    assert_same_decode(
        prepare_decode_on_device(seqs, cfg, backend="torch"), prepare_decode(seqs, cfg), cfg
    )


@pytest.mark.parametrize("seed", [10, 11])
def test_triton_interpreter_equals_eager(seed):
    rng = np.random.default_rng(seed)
    cfg = make_config(device=TRITON_DEVICE)
    seqs = random_decode_batch(rng, cfg, 3)
    assert_same_decode(
        prepare_decode_on_device(seqs, cfg, backend="triton"), prepare_decode(seqs, cfg), cfg
    )


def test_out_buffers_are_written_in_place_and_reused():
    rng = np.random.default_rng(5)
    cfg = make_config(device=TRITON_DEVICE)
    out = make_decode_device_out(cfg, max_num_seqs=8, max_total_q=24, max_seqlen_q=3)
    big = random_decode_batch(rng, cfg, 8)
    small = random_decode_batch(rng, cfg, 3)
    for seqs in (big, small):
        got = prepare_decode_on_device(seqs, cfg, out=out, backend="triton")
        assert_same_decode(got, prepare_decode(seqs, cfg), cfg)
        assert got.positions.data_ptr() == out["positions"].data_ptr()
        for field in ("positions_c", "klen", "kv_ca_index_offset_len"):
            for k, row in getattr(got, field).items():
                assert row.data_ptr() == out[field][k].data_ptr(), (field, k)
    # rows of the same stacked buffer: one storage, equal strides
    rows = list(got.positions_c.values())
    assert len({r.untyped_storage().data_ptr() for r in rows}) == 1
    assert len({r.stride() for r in rows}) == 1


def test_stack_rows_rejects_separate_tensors():
    rows = {"4": torch.zeros(8, dtype=torch.int32), "8": torch.zeros(8, dtype=torch.int32)}
    with pytest.raises(ValueError, match="positions_c"):
        stack_rows("positions_c", rows, ("4", "8"), 4, (), "cpu")
    stacked = torch.zeros(2, 8, dtype=torch.int32)
    view = stack_rows("positions_c", {"4": stacked[0], "8": stacked[1]}, ("4", "8"), 4, (), "cpu")
    assert view.shape == (2, 8) and view.data_ptr() == stacked.data_ptr()
    with pytest.raises(ValueError, match="shape"):
        stack_rows("klen", {"4": stacked[0][:2], "8": stacked[1][:2]}, ("4", "8"), 4, (), "cpu")
    with pytest.raises(TypeError, match="dtype"):
        stack_rows("klen", {"4": stacked[0].long()}, ("4",), 4, (), "cpu")


def _seq(**kw):
    base = dict(seqlen_q=2, seqlen_k=40, block_table=list(range(1, 4)), state_id=1,
                token_ids=list(range(39)), draft_tokens=[5])  # fmt: skip
    base.update(kw)
    return SequenceMetadata(**base)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"seqlen_q": 3, "seqlen_k": 2, "token_ids": [], "draft_tokens": [1, 2]}, "seqlen_k"),
        ({"block_table": [1]}, "block_table"),
        ({"block_table": [1, 2, 99]}, "block_table = 99"),
        ({"block_table": [1, -2, 3]}, "block_table = -2"),
        ({"state_id": 16}, "state_id"),
        ({"draft_tokens": []}, "seqlen_q"),
        ({"token_ids": list(range(10))}, "token_ids"),
        ({"swa_valid_start": 39}, "swa_valid_start"),
        ({"seqlen_q": 2.0}, "seqlen_q"),
    ],
)
def test_bad_input_raises_before_writing(kw, match):
    cfg = make_config()
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=8, max_seqlen_q=3)
    before = out["decode_inputs"].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        prepare_decode_on_device([_seq(), _seq(**kw)], cfg, out=out)
    assert torch.equal(out["decode_inputs"], before)


def test_bad_out_buffers():
    cfg = make_config()
    seqs = [_seq(), _seq()]
    out = make_decode_device_out(cfg, max_num_seqs=1, max_total_q=8, max_seqlen_q=3)
    with pytest.raises(ValueError, match="sequences"):
        prepare_decode_on_device(seqs, cfg, out=out)
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=8, max_seqlen_q=3)
    out["context_lens"] = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(TypeError, match="context_lens"):
        prepare_decode_on_device(seqs, cfg, out=out)
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=8, max_seqlen_q=3)
    out["kv_swa_index_offset_len"] = torch.zeros(8, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_swa_index_offset_len"):
        prepare_decode_on_device(seqs, cfg, out=out)
    with pytest.raises(ValueError, match="make_decode_device_out"):
        prepare_decode_on_device(seqs, cfg, out={"positions": torch.zeros(8)})


def test_int32_overflow_of_decode_ca_offsets():
    cfg = make_config(block_size=1024, dense_ratios=(1,), sparse_ratios=(), max_model_len=2**21,
                      max_num_blocks=2**11, num_kv_blocks=None)  # fmt: skip
    seqs = [_seq(block_table=[1], seqlen_k=40) for _ in range(600)]
    with pytest.raises(ValueError, match="overflows int32"):
        prepare_decode_on_device(seqs, cfg)


@pytest.mark.parametrize(("n_ca", "n_sparse", "n_dense", "tile_q"), [(3, 2, 2, 4), (0, 0, 0, 1)])
def test_kernels_compile_for_sm90(n_ca, n_sparse, n_dense, tile_q):
    from kvplan.plan.decode_kernels import _decode_metadata_kernel, _expand_block_tables_kernel

    sig = {n: "*i32" for n in JITArgs.metadata if n.endswith("_ptr")}
    sig.update(valid_ptr="*i1", gate_ptr="*i1")
    compile_sm90(_decode_metadata_kernel, signature=sig,
                 N_CA=n_ca, N_SPARSE=n_sparse, N_DENSE=n_dense, TILE_Q=tile_q)  # fmt: skip
    sig = {n: "*i32" for n in JITArgs.expand if n.endswith("_ptr")}
    compile_sm90(_expand_block_tables_kernel, signature=sig, TILE_Q=tile_q, TILE_B=256)


class JITArgs:
    """Argument names of the two kernels (pointer names end in ``_ptr``)."""

    from kvplan.plan.decode_kernels import _decode_metadata_kernel as _k1
    from kvplan.plan.decode_kernels import _expand_block_tables_kernel as _k2

    metadata = _k1.arg_names
    expand = _k2.arg_names


def test_replaying_the_big_launch_serves_a_smaller_batch():
    """CPU counterpart of the CUDA-graph test: the launch staged for the capture batch, run
    again after a smaller batch was staged into the same buffers, yields the smaller batch."""
    from kvplan.plan.decode_device import launch_decode_kernels, stage_decode_on_device

    rng = np.random.default_rng(21)
    cfg = make_config(device=TRITON_DEVICE)
    out = make_decode_device_out(cfg, max_num_seqs=6, max_total_q=18, max_seqlen_q=3)
    big = stage_decode_on_device(random_decode_batch(rng, cfg, 6), cfg, out=out)
    launch_decode_kernels(big, "triton")
    before = {k: out[k].clone() for k in ("positions", "context_lens", "block_tables")}
    before["klen"] = out["klen"]["8"].clone()
    small_seqs = random_decode_batch(rng, cfg, 2)
    small = stage_decode_on_device(small_seqs, cfg, out=out)
    launch_decode_kernels(big, "triton")  # the "captured" launch
    assert_same_decode(small.meta, prepare_decode(small_seqs, cfg), cfg)
    t = small.meta.total_q  # rows past the smaller batch are left as they were (prefix writes)
    for k in ("positions", "context_lens", "block_tables"):
        assert torch.equal(out[k][t:], before[k][t:]), k
    assert torch.equal(out["klen"]["8"][t:], before["klen"][t:])


@pytest.mark.gpu
@pytest.mark.parametrize(("seed", "n_seq"), [(0, 1), (1, 7), (2, 256)])
def test_gpu_kernels_equal_eager(seed, n_seq):
    rng = np.random.default_rng(seed)
    cfg = make_config(device="cuda", max_ngram_size=2)
    seqs = random_decode_batch(rng, cfg, n_seq)
    add_engram_ids(seqs)
    got = prepare_decode_on_device(seqs, cfg)
    torch.cuda.synchronize()
    assert got.positions.is_cuda and got.klen["4"].is_cuda
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_smaller_replay():
    """Capture metadata kernels + compute_attn_info at 8 sequences; replay with 3."""
    from kvplan.ops import kv_ca_index_width
    from kvplan.plan.config import ratio_key
    from kvplan.plan.decode_device import launch_decode_kernels, stage_decode_on_device

    rng = np.random.default_rng(7)
    cfg = make_config(device="cuda")
    n_cap, q_cap = 8, 24
    out = make_decode_device_out(cfg, max_num_seqs=n_cap, max_total_q=q_cap, max_seqlen_q=3)
    attn_out = {
        "kv_ca_index": {
            ratio_key(r): torch.empty(q_cap, kv_ca_index_width(cfg.max_model_len // r),
                                      dtype=torch.int32, device="cuda")
            for r in cfg.dense_ratios
        },
        "kv_ca_index_len": {ratio_key(r): torch.empty(q_cap, dtype=torch.int32, device="cuda")
                            for r in cfg.dense_ratios},
        "kv_swa_index": torch.empty(q_cap, cfg.window_size, dtype=torch.int32, device="cuda"),
    }  # fmt: skip
    big_seqs = random_decode_batch(rng, cfg, n_cap, max_draft=2)
    big = stage_decode_on_device(big_seqs, cfg, out=out)
    launch_decode_kernels(big)  # warm-up: compile outside the capture
    big.meta.compute_attn_info(cfg, out=attn_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_decode_kernels(big)
        big.meta.clean()
        big.meta.compute_attn_info(cfg, out=attn_out)
    for seqs in (random_decode_batch(rng, cfg, 3), big_seqs):
        staged = stage_decode_on_device(seqs, cfg, out=out)
        graph.replay()
        torch.cuda.synchronize()
        want = prepare_decode(seqs, cfg)
        assert_same_decode(staged.meta, want, cfg)
        want.compute_attn_info(cfg)
        t = want.total_q
        assert torch.equal(attn_out["kv_swa_index"][:t], want.kv_swa_index)
        for k, v in want.kv_ca_index.items():
            assert torch.equal(attn_out["kv_ca_index"][k][:t], v), k
            assert torch.equal(attn_out["kv_ca_index_len"][k][:t], want.kv_ca_index_len[k]), k


def test_replaced_out_buffer_is_checked_again():
    rng = np.random.default_rng(31)
    cfg = make_config()
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=12, max_seqlen_q=3)
    seqs = random_decode_batch(rng, cfg, 3)
    prepare_decode_on_device(seqs, cfg, out=out)  # binds (checks once, caches views)
    out["klen"] = {"4": torch.zeros(12, dtype=torch.int32), "8": torch.zeros(12, dtype=torch.int32)}
    with pytest.raises(ValueError, match="klen"):
        prepare_decode_on_device(seqs, cfg, out=out)
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=12, max_seqlen_q=3)
    prepare_decode_on_device(seqs, cfg, out=out)
    out["positions"] = torch.zeros(12, dtype=torch.int64)
    with pytest.raises(TypeError, match="positions"):
        prepare_decode_on_device(seqs, cfg, out=out)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_torch_path_equals_eager_on_random_configs(seed):
    """Wide configs (no ratios, one ratio, Engram with images, placeholders, valid starts)."""
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    seqs = plan_cases_decode_batch(rng, cfg)
    assert_same_decode(
        prepare_decode_on_device(seqs, cfg, backend="torch"), prepare_decode(seqs, cfg), cfg
    )


@pytest.mark.parametrize("seed", [40, 41, 42])
def test_interpreter_on_random_configs_and_oracle(seed):
    """The Triton kernels (interpreter) on wide configs, then the visibility oracle."""
    from kvplan.plan.visibility import check_visibility

    rng = np.random.default_rng(seed)
    cfg = random_config(rng, device=TRITON_DEVICE)
    seqs = plan_cases_decode_batch(rng, cfg)
    got = prepare_decode_on_device(seqs, cfg, backend="triton")
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)
    check_visibility(got, seqs, cfg)


@pytest.mark.parametrize("spare", [[-1, 7], [2**40, 3]])
def test_spare_block_table_entries_are_ignored(spare):
    """Entries past num_blocks_for(seqlen_k) are never read, so they may hold anything (here:
    -1, an id past num_kv_blocks, beyond int32); every sequence has as many drafts (the host
    path's [n, seqlen_q] input-id layout)."""
    rng = np.random.default_rng(50)
    cfg = make_config()
    seqs = random_decode_batch(rng, cfg, 5)
    for i, s in enumerate(seqs):
        s.draft_tokens = [3, 4]
        s.seqlen_q = 3
        s.seqlen_k = max(s.seqlen_k, 3)
        s.token_ids = list(range(s.seqlen_k - 2))
        s.swa_valid_start = 0
        nb = cfg.num_blocks_for(s.seqlen_k)
        table = np.asarray(rng.integers(0, cfg.num_kv_blocks, nb), dtype=np.int64)
        s.block_table = np.concatenate([table, spare[: i % 3]]).astype(np.int64)
    got = prepare_decode_on_device(seqs, cfg, backend="torch")
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)


def test_block_ids_checked_past_spare_entries():
    """A bad id among the used entries is reported with its sequence even when earlier tables
    hold spare entries (the compaction shifts positions)."""
    cfg = make_config()
    seqs = [_seq(block_table=[1, 2, 3, 60, 61]), _seq(block_table=[4, 5, 6, 7]),
            _seq(block_table=[8, 64, 9])]  # fmt: skip
    with pytest.raises(ValueError, match=r"seqs\[2\]\.block_table = 64"):
        prepare_decode_on_device(seqs, cfg)
    seqs[2].block_table = [8, 9, 10]
    seqs[1].block_table = [4, -5, 6, 7]
    with pytest.raises(ValueError, match=r"seqs\[1\]\.block_table = -5"):
        prepare_decode_on_device(seqs, cfg)
    big = make_config(num_kv_blocks=None, block_size=16)
    seqs[1].block_table = [4, 2**27, 6, 7]  # (id + 1) * block_size - 1 > int32
    with pytest.raises(ValueError, match="block id"):
        prepare_decode_on_device(seqs, big)


def test_table_and_flag_types_match_eager():
    """Float block ids raise TypeError (never truncated into a valid id); int32 arrays, lists
    and truthy placeholder flags give the eager fields."""
    cfg = make_config()
    with pytest.raises(TypeError, match="block_table entries must be integers"):
        prepare_decode_on_device([_seq(), _seq(block_table=[1.0, 2.5, 3.0])], cfg)
    seqs = [_seq(block_table=np.array([1, 2, 3], dtype=np.int32)), _seq(is_placeholder=None),
            _seq(is_placeholder=2, seqlen_q=1, draft_tokens=[], token_ids=list(range(40))),
            _seq(is_placeholder=1.0)]  # fmt: skip
    got = prepare_decode_on_device(seqs, cfg, backend="torch")
    assert got.valid_token_mask.tolist() == [True, True, True, True, False, False, False]
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)


@pytest.mark.parametrize(
    ("field", "value"),
    [("state_id", None), ("state_id", "1"), ("swa_valid_start", 0.5), ("seqlen_k", 2**70)],
)
def test_non_integer_facts_are_named(field, value):
    """A fact that is not an int never reaches numpy's silent conversions (``"1"`` -> 1,
    ``0.5`` -> 0): the per-sequence checks name it."""
    with pytest.raises((ValueError, TypeError), match=field):
        prepare_decode_on_device([_seq(), _seq(**{field: value})], make_config())
