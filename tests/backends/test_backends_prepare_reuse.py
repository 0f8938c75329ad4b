"""One metadata object reused step after step gives the same tensors as a fresh one.

The backends stage every per-step field into capacity-sized device arenas that persist across
steps (vanilla included: ``seq_lens``, the int64 slots and the block tables share one arena),
so a smaller batch after a larger one must not read anything a previous step left behind.
"""

from __future__ import annotations

import pytest
import torch
from backends_testlib import CAP, fill_metadata, make_scenario, random_specs, step_tensors, subset

from kvplan.backends import get_backend


def check_reuse(name: str, device: str) -> None:
    specs = random_specs(5, num_ctx=4, num_gen=6)
    sc = make_scenario(5, specs, layer_windows=(None, 8), device=device)  # two pools (VSWA)
    cls = get_backend(name).Metadata
    reused = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, **CAP)
    pools = sc.manager.num_pools
    # big mixed batch, decode-only subset, a smaller mixed batch, the big batch again
    batches = [sc, subset(sc, [4, 6, 9]), subset(sc, [1, 7]), sc]
    for step, batch in enumerate(batches):
        fill_metadata(reused, batch)
        reused.prepare()
        fresh = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, **CAP)
        fill_metadata(fresh, batch)
        fresh.prepare()
        got, want = step_tensors(reused, name, pools), step_tensors(fresh, name, pools)
        assert got == want, f"step {step}"
    if name == "vanilla":
        assert reused.slot_mapping(0).dtype == torch.int64


@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_reused_metadata_equals_fresh_prepare(name):
    check_reuse(name, "cpu")  # CPU arenas write in place


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_gpu_reused_metadata_equals_fresh_prepare(name):
    check_reuse(name, "cuda")  # CUDA arenas stage through pinned snapshots + async copies
