"""`StateSnapshots`: what a snapshot copies (bit for bit), and its bookkeeping (pending until
hashed, registered by hash, least recently used eviction, one decode snapshot a request)."""

from __future__ import annotations

import pytest
import torch
from hybrid_oracle import make_layers

from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.backends.hybrid.snapshots import StateSnapshots

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


def family(kv_format: str = "exact") -> PlannedHybridFamily:
    layers = make_layers([SLIDING, CSA, HCA], 8, {CSA: 4, HCA: 8})
    return PlannedHybridFamily(layers, block_size=16, num_blocks=8, num_state_slots=4,
                               max_model_len=64, kv_format=kv_format)  # fmt: skip


def fill_random(fam: PlannedHybridFamily, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in fam.caches:
        ring = layer.ring.cache
        ring.copy_(torch.randint(0, 256, ring.shape, generator=g, dtype=torch.uint8))
        for kv_gate in layer.state.values():
            for t in kv_gate:
                t.copy_(torch.randn(t.shape, generator=g))


def slot_state(fam: PlannedHybridFamily, sid: int) -> dict[str, torch.Tensor]:
    """Everything state slot ``sid`` holds, by name (HCA state included)."""
    out = {}
    for i, layer in enumerate(fam.caches):
        out[f"ring{i}"] = layer.ring.cache[sid].clone()
        big_r = 2 * layer.spec.ratio if layer.spec.overlap else layer.spec.ratio
        for name, (kv, gate) in layer.state.items():
            rows = slice(sid * big_r, (sid + 1) * big_r)
            out[f"{name}{i}.kv"] = kv[rows].clone()
            out[f"{name}{i}.gate"] = gate[rows].clone()
    return out


@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
def test_restore_gives_the_snapshotted_slot_bit_for_bit(kv_format):
    fam = family(kv_format)
    fill_random(fam, 0)
    snaps = StateSnapshots(fam, 2)
    before = slot_state(fam, 1)
    assert snaps.take([("a", 0, 1, False)]) == 1
    assert snaps.num_pending == 1 and snaps.lookup(b"h0") is None
    snaps.register("a", 0, [b"h0"])
    assert snaps.num_pending == 0 and snaps.lookup(b"h0") is not None
    fill_random(fam, 1)  # the live caches move on
    others = {s: slot_state(fam, s) for s in (0, 1, 2)}
    trash = [t[-1].clone() for layer in fam.caches for kv in layer.state.values() for t in kv]
    snaps.restore(b"h0", 3)
    after = slot_state(fam, 3)
    for key, want in before.items():
        if key.startswith("compressor2"):  # HCA: nothing pending at a block boundary
            continue
        assert torch.equal(after[key], want), key
    assert any(not torch.equal(after[k], before[k]) for k in before if "compressor2" in k)
    for s, state in others.items():  # no other slot, no trash row is written
        assert all(torch.equal(slot_state(fam, s)[k], v) for k, v in state.items())
    now = [t[-1] for layer in fam.caches for kv in layer.state.values() for t in kv]
    assert all(torch.equal(x, y) for x, y in zip(now, trash))
    assert snaps.num_taken == 1 and snaps.num_restored == 1
    # bytes: the ring of 3 layers + the CSA layer's two series' 8 kv and 8 gate rows
    ring = fam.caches[0].ring.cache[0].numel()
    state = sum(2 * t[:8].numel() * 4 for t in (kv for kv, _ in fam.caches[1].state.values()))
    assert snaps.nbytes_per_snapshot == 3 * ring + state


def test_a_batched_take_equals_single_takes():
    """Several slots snapshotted in one call (gather / scatter) restore like one at a time
    (slice copies)."""
    fam = family("fp8")
    fill_random(fam, 3)
    want = {s: slot_state(fam, s) for s in (0, 2, 3)}
    snaps = StateSnapshots(fam, 4)
    assert snaps.take([("a", 0, 2, False), ("b", 1, 0, True), ("c", 0, 3, False)]) == 3
    for rid, block, h in (("a", 0, b"a"), ("b", 1, b"b"), ("c", 0, b"c")):
        snaps.register(rid, block, [h])
    fill_random(fam, 4)
    for h, src, dst in ((b"a", 2, 1), (b"b", 0, 2), (b"c", 3, 0)):
        snaps.restore(h, dst)
        got = slot_state(fam, dst)
        for key, value in want[src].items():
            if not key.startswith("compressor2"):
                assert torch.equal(got[key], value), (h, key)


def test_least_recently_used_eviction_and_pending_slots():
    fam = family()
    snaps = StateSnapshots(fam, 2)
    snaps.take([("a", 0, 0, False), ("b", 0, 1, False)])
    snaps.register("a", 0, [b"a0"])
    snaps.register("b", 0, [b"b0"])
    snaps.restore(b"a0", 2)  # a0 is now the most recently used
    assert snaps.take([("c", 1, 2, False)]) == 1  # evicts b0
    assert snaps.lookup(b"b0") is None and snaps.lookup(b"a0") is not None
    assert snaps.num_evicted == 1
    # every slot pending or registered: a pending one is never evicted
    assert snaps.take([("d", 0, 3, False)]) == 1  # evicts a0
    assert snaps.take([("e", 0, 3, False)]) == 0  # both pending now
    snaps.drop_pending("c")
    assert snaps.num_pending == 1 and snaps.take([("e", 0, 3, False)]) == 1
    with pytest.raises(KeyError, match="no state snapshot registered"):
        snaps.restore(b"a0", 0)


def test_a_request_keeps_its_newest_decode_snapshot_and_its_prompt_ones():
    fam = family()
    snaps = StateSnapshots(fam, 4)
    snaps.take([("a", 0, 0, False)])  # the prompt's
    snaps.register("a", 0, [b"p0"])
    snaps.take([("a", 1, 0, True)])
    snaps.register("a", 1, [b"d1"])
    snaps.take([("a", 2, 0, True)])
    snaps.register("a", 1, [b"d1", b"d2"])  # a run of hashes: only the pending one counts
    assert snaps.lookup(b"p0") is not None and snaps.lookup(b"d2") is not None
    assert snaps.lookup(b"d1") is None and snaps.num_registered == 2
    # the same hash again (a recompute): the newer copy replaces the older
    snaps.take([("b", 0, 1, False)])
    old = snaps.lookup(b"p0")
    snaps.register("b", 0, [b"p0"])
    assert snaps.lookup(b"p0") != old and snaps.num_registered == 2
    snaps.clear()
    assert snaps.num_registered == 0 and snaps.lookup(b"p0") is None
    assert snaps.take([(r, 0, 0, False) for r in "wxyz"]) == 4  # every slot free again


def test_a_discarded_pending_snapshot_frees_its_slot_and_never_registers():
    """`discard` (a speculative step's rejected drafts wrote that boundary's state): the
    slot is free again, a later hash of the block registers nothing, other points stay."""
    fam = family()
    snaps = StateSnapshots(fam, 2)
    assert snaps.take_early([("a", 3, 0, True), ("a", 4, 0, True)]) == [0, 1]
    assert snaps.discard("a", 4) and not snaps.discard("a", 4) and not snaps.discard("b", 0)
    assert snaps.num_pending == 1
    snaps.register("a", 3, [b"h3", b"h4"])
    assert snaps.lookup(b"h3") is not None and snaps.lookup(b"h4") is None
    assert snaps.num_pending == 0 and snaps.take([("b", 0, 1, False)]) == 1  # no eviction
    assert snaps.num_evicted == 0


def test_capacity_is_checked():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="capacity must be an int >= 1"):
            StateSnapshots(family(), bad)


def _allocated(fam: PlannedHybridFamily) -> int:
    """Bytes of every cache tensor the family holds (pools, rings, compressor state)."""
    total = 0
    for layer in fam.caches:
        total += layer.ring.cache.untyped_storage().nbytes()
        total += sum(p.cache.untyped_storage().nbytes() for p in layer.pools.values())
        total += sum(t.nbytes for kv_gate in layer.state.values() for t in kv_gate)
    return total


@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
def test_cache_bytes_are_what_the_family_allocates(kv_format):
    """`cache_bytes` (used to size pools from a memory budget) against the family's real
    tensors: the difference between two block counts and two slot counts, and the snapshot
    store's own size."""
    from kvplan.backends.hybrid.planned import cache_bytes

    layers = make_layers([SLIDING, CSA, HCA, CSA], 8, {CSA: 4, HCA: 8})

    def build(blocks, slots):
        return PlannedHybridFamily(layers, block_size=16, num_blocks=blocks,
                                   num_state_slots=slots, max_model_len=64,
                                   kv_format=kv_format)  # fmt: skip

    want = cache_bytes(layers, block_size=16, kv_format=kv_format)
    base = _allocated(build(4, 2))
    assert _allocated(build(9, 2)) - base == 5 * want.per_block
    trash = sum(t[-1].nbytes for c in build(4, 2).caches for kg in c.state.values() for t in kg)
    assert _allocated(build(4, 5)) - base == 3 * want.per_state_slot
    assert base == want.total(4, 2) + trash
    assert StateSnapshots(build(4, 2), 3).nbytes_per_snapshot == want.per_snapshot
