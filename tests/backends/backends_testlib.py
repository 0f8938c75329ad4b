"""Random batches for the backend tests, and a dense reference computed independently.

A ``Scenario`` owns a real ``KVCacheManager`` and ``KVCacheTensors`` whose history was written
by the test itself (per-token loop over ``get_block_ids``), the true K/V of every sequence
(``history[layer][row]``, float64), this step's q/k/v, and the per-step metadata fields. The
reference attends with a per-query loop in float64 over exactly the visible positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvplan.cache.kv_cache_manager import KVCacheManager
from kvplan.cache.kv_tensors import KVCacheTensors

# metadata capacities the backend tests share (room for every random batch they build)
CAP = {"max_num_requests": 16, "max_num_tokens": 256, "max_num_sequences": 32}


@dataclass
class SeqSpec:
    """One row of the batch before beam expansion."""

    cached: int  # tokens already in the cache
    q_len: int  # query tokens this step
    context: bool
    reserve_extra: int = 0  # extra reserved (uncommitted) tokens past this step's tokens


@dataclass
class Scenario:
    manager: KVCacheManager
    kv: KVCacheTensors
    layer_windows: list[int | None]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    request_ids: list[int]
    num_contexts: int
    beam_width: int
    seq_lens: list[int]
    cached: list[int]
    prompt_lens: list[int]
    q: torch.Tensor
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    # history[layer][row] = (K [kv_len, Hkv, D], V) float64 incl. this step's new tokens
    history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    cross: bool = False
    seq_lens_kv: list[int] | None = None


def write_slots(manager, kv, layer, block_ids, positions, k_rows, v_rows) -> None:
    """Test-side store: slot of position p = block_ids[p // bs] * bs + p % bs."""
    bs = manager.block_size
    slots = [block_ids[p // bs] * bs + p % bs for p in positions]
    dev = kv.device
    kv.store(
        layer, k_rows.to(dev), v_rows.to(dev), torch.tensor(slots, dtype=torch.int64, device=dev)
    )


class RemappedPools:
    """A real manager whose pools >= 1 name every block ``num_blocks - id`` (0 stays 0).

    The real manager hands out the same ids in every pool; this view makes pools differ so a
    test can tell which pool's table a backend read. Only the table accessors are remapped.
    """

    def __init__(self, manager: KVCacheManager, num_blocks: int) -> None:
        self._m = manager
        self._n = num_blocks

    def __getattr__(self, name):
        return getattr(self._m, name)

    def _map(self, ids, pool):
        if pool == 0:
            return ids
        a = np.asarray(ids)
        return np.where(a > 0, self._n - a, 0).astype(np.int32)

    def get_block_ids(self, rid, pool=0, *, beam=0):
        return np.asarray(self._map(self._m.get_block_ids(rid, pool, beam=beam), pool)).tolist()

    def get_block_ids_per_seq(self, rids, pool=0, **kw):
        return self._map(self._m.get_block_ids_per_seq(rids, pool, **kw), pool)

    def batch_tables(self, *args, **kw):
        bt = self._m.batch_tables(*args, **kw)
        tables = np.stack([self._map(t, p) for p, t in enumerate(bt.tables)])
        return bt._replace(tables=tables)


def _manager_and_cache(gen, layer_windows, num_heads, num_kv_heads, head_dim, block_size,
                       num_blocks, max_blocks_per_seq, kv_format, beam_width, device):  # fmt: skip
    windows: list[int | None] = []
    for w in layer_windows:
        if w not in windows:
            windows.append(w)
    manager = KVCacheManager(
        num_blocks,
        block_size,
        max_blocks_per_seq=max_blocks_per_seq,
        window_sizes=windows,
        layer_to_pool=[windows.index(w) for w in layer_windows],
        enable_prefix_caching=False,
        max_beam_width=beam_width,
    )
    kv = KVCacheTensors(
        len(layer_windows), num_blocks, block_size, num_kv_heads, head_dim,
        kv_format=kv_format, device=device,
    )  # fmt: skip
    # Garbage everywhere, so a read of an unwritten or reserved slot changes the output.
    for layer in range(len(layer_windows)):
        for c in (kv.k_cache(layer), kv.v_cache(layer)):
            if not kv.is_quantized:
                c.copy_((torch.randn(c.shape, generator=gen) * 50).to(c.dtype))
    return manager, kv


def make_scenario(
    seed: int,
    specs: list[SeqSpec],
    *,
    beam_width: int = 1,
    cross: bool = False,
    layer_windows: tuple[int | None, ...] = (None,),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    num_blocks: int = 200,
    max_blocks_per_seq: int = 24,
    kv_format: str = "fp32",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    remap_pools: bool = False,
) -> Scenario:
    """Build a batch: context specs first, then generation specs (each expands to beams).

    Self attention: a context row is a prompt chunk ``[cached, cached + q_len)`` (the prompt may
    continue past it); a generation row has ``cached`` committed tokens, this step's first token
    from ``extend`` and any further (speculative) tokens plus ``reserve_extra`` from
    ``reserve``. Beams share the prompt's history and own everything after it.

    Cross attention (``cross=True``): ``cached`` is the encoder length E; a context row writes
    its E encoder tokens this step (``seq_lens_kv = E``), a generation row only reads them.
    """
    gen = torch.Generator().manual_seed(seed)
    manager, kv = _manager_and_cache(
        gen, layer_windows, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
        max_blocks_per_seq, kv_format, beam_width, device,
    )  # fmt: skip
    if remap_pools:
        manager = RemappedPools(manager, num_blocks)
    num_layers = len(layer_windows)
    specs = sorted(specs, key=lambda s: not s.context)
    num_contexts = sum(s.context for s in specs)
    hkv, d = num_kv_heads, head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)

    history: dict[int, list] = {layer: [] for layer in range(num_layers)}
    new_k: dict[int, list] = {layer: [] for layer in range(num_layers)}
    new_v: dict[int, list] = {layer: [] for layer in range(num_layers)}
    request_ids, seq_lens, seq_lens_kv, cached, prompt_lens = [], [], [], [], []
    for rid, spec in enumerate(specs):
        rows = 1 if spec.context else beam_width
        if cross:
            enc = spec.cached
            prompt_len = spec.q_len if spec.context else 3
            prompt = torch.randint(0, 1000, (prompt_len,), generator=gen).tolist()
            assert manager.add_request(
                rid, prompt, beam_width=beam_width, num_encoder_tokens=enc
            ).ok
        else:
            total = spec.cached + spec.q_len
            if spec.context:
                prompt_len = total + int(torch.randint(0, 3, (1,), generator=gen))
            else:
                prompt_len = max(1, spec.cached - 3)
            prompt = torch.randint(0, 1000, (prompt_len,), generator=gen).tolist()
            assert manager.add_request(rid, prompt, beam_width=beam_width).ok
            if not spec.context:
                assert manager.extend(rid, spec.cached - prompt_len + 1).ok
                assert manager.reserve(rid, spec.q_len - 1 + spec.reserve_extra).ok
            elif spec.reserve_extra:
                assert manager.reserve(rid, max(0, total + spec.reserve_extra - prompt_len)).ok
        request_ids.append(rid)
        for layer in range(num_layers):
            pool = manager.pool_for_layer(layer)
            if cross:
                ek, ev = rnd(spec.cached, hkv, d), rnd(spec.cached, hkv, d)
                ids = manager.get_cross_block_ids(rid, pool)
                if not spec.context:  # encoder K/V written by an earlier step
                    write_slots(manager, kv, layer, ids, range(enc), ek.to(dtype), ev.to(dtype))
                else:
                    new_k[layer].append(ek)
                    new_v[layer].append(ev)
                history[layer].extend([(ek, ev)] * rows)
                continue
            shared_k, shared_v = rnd(prompt_len, hkv, d), rnd(prompt_len, hkv, d)
            for beam in range(rows):
                ids = manager.get_block_ids(rid, pool, beam=beam)
                own = max(total - prompt_len, 0)
                hk = torch.cat([shared_k[:total], rnd(own, hkv, d)])
                hv = torch.cat([shared_v[:total], rnd(own, hkv, d)])
                pos = range(spec.cached)
                write_slots(
                    manager,
                    kv,
                    layer,
                    ids,
                    pos,
                    hk[: spec.cached].to(dtype),
                    hv[: spec.cached].to(dtype),
                )
                history[layer].append((hk, hv))
                new_k[layer].append(hk[spec.cached : total])
                new_v[layer].append(hv[spec.cached : total])
        for _ in range(rows):
            seq_lens.append(spec.q_len)
            cached.append(0 if cross and spec.context else spec.cached)
            seq_lens_kv.append(spec.cached if cross and spec.context else 0)
            prompt_lens.append(prompt_len)
    q = torch.randn(sum(seq_lens), num_heads, head_dim, generator=gen).to(dtype)

    def cat(parts):
        if not parts:
            return torch.zeros(0, hkv, d, dtype=dtype, device=device)
        return torch.cat(parts).to(dtype).to(device)

    sc = Scenario(
        manager, kv, list(layer_windows), num_heads, num_kv_heads, head_dim, request_ids,
        num_contexts, beam_width, seq_lens, cached, prompt_lens, q.to(device),
        {layer: cat(new_k[layer]) for layer in range(num_layers)},
        {layer: cat(new_v[layer]) for layer in range(num_layers)},
        history, cross=cross, seq_lens_kv=seq_lens_kv if cross else None,
    )  # fmt: skip
    return sc


def random_specs(seed: int, *, num_ctx: int, num_gen: int, max_cached: int = 40,
                 spec_rows: bool = False) -> list[SeqSpec]:  # fmt: skip
    """Mixed batch: context chunks (some over cached history) and decode rows."""
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(num_ctx):
        cached = int(rng.integers(0, max_cached)) if rng.random() < 0.5 else 0
        specs.append(SeqSpec(cached, int(rng.integers(1, 12)), True))
    for _ in range(num_gen):
        q_len = int(rng.integers(2, 5)) if spec_rows and rng.random() < 0.6 else 1
        extra = int(rng.integers(0, 9)) if spec_rows else 0
        specs.append(SeqSpec(int(rng.integers(4, max_cached)), q_len, False, extra))
    return specs


def subset(sc: Scenario, rows: list[int]) -> Scenario:
    """The batch made of some rows of a beam-1, self-attention scenario (same manager/cache)."""
    assert sc.beam_width == 1 and not sc.cross
    starts = np.concatenate([[0], np.cumsum(sc.seq_lens)])
    tok = torch.tensor([t for r in rows for t in range(starts[r], starts[r + 1])], dtype=torch.long)
    tok = tok.to(sc.q.device)
    pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
    return Scenario(
        sc.manager, sc.kv, sc.layer_windows, sc.num_heads, sc.num_kv_heads, sc.head_dim,
        pick(sc.request_ids), sum(r < sc.num_contexts for r in rows), 1, pick(sc.seq_lens),
        pick(sc.cached), pick(sc.prompt_lens), sc.q[tok],
        {layer: x[tok] for layer, x in sc.k.items()}, {layer: x[tok] for layer, x in sc.v.items()},
        {layer: pick(h) for layer, h in sc.history.items()},
    )  # fmt: skip


def fill_metadata(md, sc: Scenario) -> None:
    md.request_ids = list(sc.request_ids)
    md.beam_width = sc.beam_width
    md.num_contexts = sc.num_contexts
    md.seq_lens = sc.seq_lens
    md.num_cached_tokens_per_seq = sc.cached
    md.prompt_lens = sc.prompt_lens
    if sc.seq_lens_kv is not None:
        md.seq_lens_kv = sc.seq_lens_kv


def reference_attention(
    sc: Scenario,
    layer: int,
    window: int | None,
    scale: float | None = None,
    selected_blocks: list[set[int]] | None = None,
):
    """Dense per-query float64 reference: ``[num_tokens, H, D]``.

    ``selected_blocks[row]``: logical blocks a sparse selection keeps (None = all).
    """
    h, hkv, d = sc.num_heads, sc.num_kv_heads, sc.head_dim
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = sc.q.to(torch.float64).cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    t = 0
    for row, q_len in enumerate(sc.seq_lens):
        kk, vv = sc.history[layer][row]
        kv_len = kk.shape[0]
        for i in range(q_len):
            p = kv_len - q_len + i
            if sc.cross:
                visible = list(range(kv_len))
            else:
                lo = 0 if window is None else max(0, p - window + 1)
                visible = list(range(lo, p + 1))
            if selected_blocks is not None:
                bs = sc.manager.block_size
                visible = [j for j in visible if j // bs in selected_blocks[row]]
            idx = torch.tensor(visible, dtype=torch.long)
            heads = torch.arange(h) // (h // hkv)  # KV head of each query head
            k_vis = kk[idx][:, heads]  # [V, H, D]
            v_vis = vv[idx][:, heads]
            s = torch.einsum("hd,vhd->hv", q[t], k_vis) * scale
            out[t] = torch.einsum("hv,vhd->hd", torch.softmax(s, dim=1), v_vis)
            t += 1
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0):
    a = actual.detach().to(torch.float64).cpu()
    torch.testing.assert_close(a, expected, atol=atol, rtol=rtol)


def row_blocks(sc: Scenario, row: int, pool: int, num_blocks: int) -> list[int]:
    """The manager's first ``num_blocks`` blocks of batch row ``row`` (test-side expansion of
    beams and cross rows)."""
    nc, beam_width = sc.num_contexts, sc.beam_width
    rid = sc.request_ids[row if row < nc else nc + (row - nc) // beam_width]
    if sc.cross:
        return sc.manager.get_cross_block_ids(rid, pool)[:num_blocks]
    beam = 0 if row < nc else (row - nc) % beam_width
    return sc.manager.get_block_ids(rid, pool, beam=beam)[:num_blocks]


def fp8_reference(sc: Scenario, layer: int, window: int | None) -> torch.Tensor:
    """``reference_attention`` over the K/V an fp8 cache holds: each row's history is read
    back through ``KVCacheTensors.read_blocks`` (the dequantized stored values)."""
    bs, hkv, d = sc.manager.block_size, sc.num_kv_heads, sc.head_dim
    pool = sc.manager.pool_for_layer(layer)
    for row in range(len(sc.seq_lens)):
        kv_len = sc.history[layer][row][0].shape[0]
        ids = row_blocks(sc, row, pool, -(-kv_len // bs))
        kk, vv = sc.kv.read_blocks(layer, torch.tensor(ids, device=sc.kv.device))
        sc.history[layer][row] = (
            kk.reshape(-1, hkv, d)[:kv_len].double().cpu(),
            vv.reshape(-1, hkv, d)[:kv_len].double().cpu(),
        )
    return reference_attention(sc, layer, window)


def step_tensors(md, name: str, num_pools: int) -> dict[str, list]:
    """Every device field one step's kernels read (as lists), plus the host tables."""
    n = md.num_seqs
    out = {"seq_lens_gpu": md.seq_lens_gpu.tolist()}
    for p in range(num_pools):
        slots = md.slot_mapping(p)
        out[f"slots{p}"] = (str(slots.dtype), slots.tolist())
    if name == "vanilla":
        for p in range(num_pools):
            table = md.block_ids_per_seq_gpu[p]
            assert torch.equal(table.cpu(), torch.from_numpy(md.block_ids_per_seq[p]))
            out[f"table{p}"] = table.tolist()
    elif name == "ragged":
        out["qo_indptr"] = md.qo_indptr[: n + 1].tolist()
        for field in ("paged_kv_indptr", "paged_kv_indptr_prefill", "paged_kv_indptr_decode",
                      "paged_kv_last_page_len", "kv_lens", "batch_indices", "positions"):  # fmt: skip
            out[field] = getattr(md, field).tolist()
        for p in range(num_pools):
            out[f"indices{p}"] = md.paged_kv_indices(p).tolist()
        out["qo_decode"] = md.arena.view("qo_indptr_decode")[: md.num_generations + 1].tolist()
    else:
        out["qo_indptr"] = md.qo_indptr[: n + 1].tolist()
        out["qo_gen"] = md.arena.view("qo_indptr_gen")[: md.num_generations + 1].tolist()
        out["kv_lens_cuda"] = md.kv_lens_cuda.tolist()
        out["types"] = md.host_request_types[:n].tolist()
        out["totals"] = md.host_total_kv_lens.tolist()
        w = md.copied_width
        out["offsets"] = md.kv_cache_block_offsets[:, :n, :, :w].tolist()
    return out


def host_arrays(md, name: str) -> dict[str, list]:
    """The host arrays ``prepare()`` leaves on the metadata (beyond the device fields)."""
    out = {
        "kv_lens_np": md.kv_lens_np.tolist(),
        "cu_seqlens_q_np": md.cu_seqlens_q_np.tolist(),
        "cu_seqlens_kv_np": md.cu_seqlens_kv_np.tolist(),
        "max_kv_len": md.max_kv_len,
        "num_ctx_tokens": md.num_ctx_tokens,
    }
    if name == "vanilla":
        out["num_blocks_np"] = md.num_blocks_np.tolist()
        out["tables"] = [t.tolist() for t in md.block_ids_per_seq]
    elif name == "ragged":
        for field in ("num_blocks_np", "logical_num_blocks_np", "paged_kv_indptr_np",
                      "paged_kv_last_page_len_np", "batch_indices_np", "positions_np"):  # fmt: skip
            out[field] = getattr(md, field).tolist()
        out["indices"] = [t.tolist() for t in md.paged_kv_indices_np]
    else:
        out["kv_lens"] = md.kv_lens.tolist()
        if md.enable_block_id_tables:
            out["kv_block_ids_per_seq"] = md.kv_block_ids_per_seq.tolist()
            out["block_ids_per_seq"] = md.block_ids_per_seq.tolist()
    return out


def assert_same(name: str, sc, a, b) -> None:
    """Two metadata objects prepared for one step give the same device fields and host
    arrays."""
    pools = sc.manager.num_pools
    assert step_tensors(a, name, pools) == step_tensors(b, name, pools)
    assert host_arrays(a, name) == host_arrays(b, name)


def prepared_each(name: str, sc, md_kwargs: dict, attr: str, values, device: str = "cpu"):
    """The batch prepared once per value of the metadata attribute ``attr`` (a switch
    between two paths that must agree), each on its own metadata object."""
    from kvplan.backends import get_backend

    out = []
    for value in values:
        md = get_backend(name).Metadata(
            kv_cache_manager=sc.manager, kv_cache=sc.kv, device=device, **md_kwargs
        )
        setattr(md, attr, value)
        fill_metadata(md, sc)
        md.prepare()
        out.append(md)
    return out
