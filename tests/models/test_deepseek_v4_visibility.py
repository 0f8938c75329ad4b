"""Visibility: what each query row attends in kvplan's reference family equals Hugging Face's.

HF's masks are captured with forward hooks during its full forward: the sliding-window mask
handed to every attention layer (``attention_mask``, 0 = visible), HCA's causal block bias
and CSA's block bias built from the indexer's top-k (the compressor's second output, 0 =
visible); the indexer's own top-k indices (``-1`` = invalid) are checked against it too. The
reference family runs the same tokens in chunks (boundaries inside compression windows) and
reports, per row and layer, its visible ``("raw", position)`` / ``("compressed", j)`` pairs.
"""

from __future__ import annotations

import random

import pytest
import torch
from dsv4_testlib import random_tokens, run_step, saved_pair

from kvplan.backends.hybrid.reference import ReferenceHybridFamily


def _hf_visible(hf, ids: list[int]) -> list[list[frozenset]]:
    """Per layer, per row: HF's visible (source, position) pairs in its full forward."""
    layers = hf.model.layers
    raw: dict[int, torch.Tensor] = {}
    comp: dict[int, torch.Tensor] = {}
    topk: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn

        def grab_mask(mod, args, kwargs, i=i):
            raw[i] = kwargs["attention_mask"][0, 0].clone()

        handles.append(attn.register_forward_pre_hook(grab_mask, with_kwargs=True))
        if attn.compressor is not None:

            def grab_bias(mod, args, out, i=i):
                comp[i] = out[1][0, 0].clone()

            handles.append(attn.compressor.register_forward_hook(grab_bias))
            if hasattr(attn.compressor, "indexer"):

                def grab_topk(mod, args, out, i=i):
                    topk[i] = out[0].clone()

                handles.append(attn.compressor.indexer.register_forward_hook(grab_topk))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    result = []
    for i in range(len(layers)):
        rows = []
        for t in range(len(ids)):
            seen = [("raw", int(j)) for j in torch.nonzero(raw[i][t] == 0).flatten()]
            if i in comp:
                seen += [("compressed", int(j)) for j in torch.nonzero(comp[i][t] == 0).flatten()]
            if i in topk:
                picked = {int(j) for j in topk[i][t] if j >= 0}
                assert picked == {j for s, j in seen if s == "compressed"}, (i, t)
            rows.append(frozenset(seen))
        result.append(rows)
    return result


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_visible_sets_equal_hf_masks(tmp_path, seed):
    hf, model = saved_pair(tmp_path, seed)
    ids = random_tokens(seed + 40, 43)
    want = _hf_visible(hf, ids)
    family = ReferenceHybridFamily(model.config.layer_specs())
    rng = random.Random(seed)
    got = [[] for _ in want]
    start = 0
    while start < len(ids):
        n = min(rng.randint(1, 7), len(ids) - start)
        _, ctx = run_step(model, family, [(0, ids, start, n)])
        for i in range(len(want)):
            got[i] += ctx.visible(i)
        start += n
    specs = model.config.layer_specs()
    for i, spec in enumerate(specs):
        assert got[i] == want[i], f"layer {i} ({spec.kind})"
        if spec.kind == "compressed_sparse_attention":  # top-k really selects something
            last = got[i][-1]
            closed = len(ids) // spec.ratio
            assert len([s for s, _ in last if s == "compressed"]) == spec.top_k < closed
        if spec.kind != "sliding_attention":  # compressed entries are reached at all
            assert any(s == "compressed" for s, _ in got[i][-1])
        assert spec.window < len(ids)
