"""Device expansion (``expand_on_device``) against the host path on the same batches.

With ``expand_on_device`` a general step's per-token slots (ragged: also positions and batch
indices) and the ragged page list are written by ``expand_step_kernel`` from per-row facts
instead of numpy on the host. Every device field the kernels read, and every host array the
metadata exposes (the ragged ``*_np`` ones are recomputed on first read), must be identical
to the host path's, on random mixed batches (chunked prefill over history, speculative rows,
beams, VSWA pools, reserved pages, draft tokens); and the attention must equal the dense
reference. On CPU the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``); on a GPU
it runs compiled, relaunched through the cached launcher.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import (
    CAP,
    SeqSpec,
    assert_close,
    assert_same,
    fill_metadata,
    make_scenario,
    prepared_each,
    random_specs,
    reference_attention,
    subset,
)

from kvplan.backends import get_backend

VARIANTS = [
    ("vanilla", {}),
    ("ragged", {"check_page_table": True}),
    ("ragged", {"use_full_generation_page_table": True}),
    ("block_offsets", {}),
    ("block_offsets", {"num_extra_kv_tokens": 2, "enable_block_id_tables": True}),
]


def prepared_both_ways(name, sc, md_kwargs, device="cpu"):
    """(host path, device path) metadata for the same batch."""
    return prepared_each(name, sc, {**CAP, **md_kwargs}, "expand_on_device", (False, True),
                         device)  # fmt: skip


def launches(md) -> int:
    return 0 if md._expander is None else md._expander.launches


def mixed_scenario(seed: int, md_kwargs: dict, **kw):
    rng = np.random.default_rng(seed)
    specs = random_specs(seed, num_ctx=int(rng.integers(1, 4)), num_gen=int(rng.integers(0, 4)),
                         spec_rows=seed % 2 == 1)  # fmt: skip
    for s in specs:  # every row owns blocks for the draft tokens past it
        s.reserve_extra = max(s.reserve_extra, md_kwargs.get("num_extra_kv_tokens", 0))
    return make_scenario(
        seed, specs, beam_width=1 + (seed % 3 == 2), block_size=int(rng.choice([2, 4, 8])),
        layer_windows=(None, 6) if seed >= 2 else (None,), max_blocks_per_seq=28, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "md_kwargs"), VARIANTS)
@pytest.mark.parametrize("seed", range(4))
def test_device_expansion_equals_host_path(name, md_kwargs, seed):
    sc = mixed_scenario(seed, md_kwargs)
    host, dev = prepared_both_ways(name, sc, md_kwargs)
    assert launches(host) == 0 and launches(dev) == 1
    assert_same(name, sc, host, dev)
    for layer, window in enumerate(sc.layer_windows):
        attn = get_backend(name)(
            layer, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window
        )
        out = attn.forward(sc.q, sc.k[layer], sc.v[layer], dev)
        assert_close(out, reference_attention(sc, layer, window), atol=1e-5)


@pytest.mark.parametrize("full_table", [False, True])
def test_ragged_decode_expands_pages_and_tokens(full_table):
    """A decode step's page list and per-row token fields come from the kernel too."""
    rng = np.random.default_rng(5)
    specs = [SeqSpec(int(rng.integers(1, 60)), 1, False, int(rng.integers(0, 9))) for _ in range(5)]
    sc = make_scenario(5, specs, block_size=4)
    kw = {"use_full_generation_page_table": full_table}
    host, dev = prepared_both_ways("ragged", sc, kw)
    assert dev.one_kv_token_per_row and launches(dev) == 1
    assert dev._batch_indices_np is None  # token fields came from the device
    assert_same("ragged", sc, host, dev)


@pytest.mark.parametrize("name", ["vanilla", "block_offsets"])
def test_decode_steps_launch_nothing(name):
    """vanilla / block_offsets decode steps have nothing per token to expand (O(rows))."""
    specs = [SeqSpec(9, 1, False), SeqSpec(30, 1, False)]
    sc = make_scenario(6, specs)
    host, dev = prepared_both_ways(name, sc, {})
    assert launches(dev) == 0
    assert_same(name, sc, host, dev)


@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_cross_steps_stay_on_the_host(name):
    specs = [SeqSpec(0, 5, True), SeqSpec(7, 1, False)]
    sc = make_scenario(7, specs, cross=True)
    host, dev = prepared_both_ways(name, sc, {})
    assert launches(dev) == 0
    assert_same(name, sc, host, dev)


def test_reused_metadata_expands_each_step():
    """One object, several batches of one manager: every step's expansion is its own."""
    specs = random_specs(8, num_ctx=3, num_gen=4)
    sc = make_scenario(8, specs, layer_windows=(None, 6))
    md = get_backend("ragged").Metadata(
        kv_cache_manager=sc.manager, kv_cache=sc.kv, **CAP, check_page_table=True
    )
    md.expand_on_device = True
    for rows in ([0, 1, 2, 3, 4, 5, 6], [2, 5], [0, 6], [1, 3, 4]):
        part = subset(sc, rows)
        ref, _ = prepared_both_ways("ragged", part, {})
        fill_metadata(md, part)
        md.prepare()
        assert_same("ragged", part, ref, md)
        out = get_backend("ragged")(
            1, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=6
        ).forward(part.q, part.k[1], part.v[1], md)
        assert_close(out, reference_attention(part, 1, 6), atol=1e-5)
    assert not md.page_table_reports


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "md_kwargs"), VARIANTS)
@pytest.mark.parametrize("seed", range(3))
def test_gpu_device_expansion_equals_host_path(name, md_kwargs, seed):
    """Compiled kernel, relaunched through the cached launcher: second and third steps too."""
    sc = mixed_scenario(seed, md_kwargs, device="cuda")
    cls = get_backend(name).Metadata
    host = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, device="cuda", **CAP, **md_kwargs)
    host.expand_on_device = False
    dev = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, device="cuda", **CAP, **md_kwargs)
    assert dev.expand_on_device  # the default on a GPU
    for step in range(3):
        for md in (host, dev):
            fill_metadata(md, sc)
            md.prepare()
        torch.cuda.synchronize()
        assert launches(dev) == step + 1
        assert_same(name, sc, host, dev)
    assert dev._expander.direct_launches == 2  # steps 2 and 3: through the cached launcher
