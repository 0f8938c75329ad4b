"""DeepSeek-V4 blocks on their fused paths: the batched MoE experts equal the sparse path and
the per-expert loop; the whole tiny model with every Triton path forced (interpreter on CPU)
still matches Hugging Face; on a GPU the kernels equal the torch path and a captured
hyper-connection + MoE block replays equal to eager."""

from __future__ import annotations

import pytest
import torch
from dsv4_testlib import hf_config, hf_logits, random_tokens, run_step, saved_pair

from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from kvplan.models.deepseek_v4.hyper import hyper_residual
from kvplan.models.deepseek_v4.layers import rms_norm
from kvplan.models.deepseek_v4.moe import graph_safe_routing
from kvplan.ops.hyper_connection import hc_post_torch, hc_pre_torch
from kvplan.ops.rms_norm import rms_norm_fp32w_torch

ATOL = 1e-4  # as tests/models/test_deepseek_v4_model.py


def _model(seed: int, device: str = "cpu", std: float = 0.3, **overrides) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_hf(hf_config(seed, **overrides))
    with torch.device(device):
        return init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=std)


@pytest.mark.parametrize("force_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("num_rows", [1, 6])
def test_batched_experts_equal_sparse_and_loop(num_rows, force_triton, monkeypatch):
    if force_triton:
        monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    model = _model(3, n_routed_experts=5, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(num_rows)
    for layer in model.layers:
        moe = layer.mlp
        x = torch.randn(num_rows, moe.gate_weight.shape[1], generator=gen)
        ids = torch.randint(0, 96, (num_rows,), generator=gen)
        with torch.no_grad():
            r_ids, r_w, dense = moe.route_dense(x, ids)
            batched = moe.experts_batched(x, dense)
            sparse = moe.experts_sparse(x, r_ids, r_w)
            loop = moe.experts_dense_loop(x, r_ids, r_w)
            with graph_safe_routing(moe):
                full = moe(x, ids)
            want_full = sparse + moe.shared(x)
        assert sparse.abs().max() > 0.1
        torch.testing.assert_close(batched, sparse, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batched, loop, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(full, want_full, atol=1e-6, rtol=1e-5)


def test_dense_rule_is_cuda_and_decode_sized_only():
    moe = _model(0, n_routed_experts=4, num_experts_per_tok=2).layers[0].mlp
    x = torch.zeros(8, moe.gate_weight.shape[1])
    assert not moe.use_dense(x)  # CPU: sparse unless asked
    with graph_safe_routing(moe):
        assert moe.use_dense(x)


@pytest.mark.parametrize("seed", [1, 3])  # n = 3 sqrt-softplus; n = 2, 20 iterations
def test_model_with_triton_paths_matches_hf(seed, tmp_path, monkeypatch):
    hf, model = saved_pair(tmp_path, seed)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    ids = random_tokens(seed, 11)
    family = ReferenceHybridFamily(model.config.layer_specs())
    with graph_safe_routing(model):
        (prefill,), _ = run_step(model, family, [(1, ids, 0, 9)])
        (decode,), _ = run_step(model, family, [(1, ids, 9, 2)])
    want = hf_logits(hf, ids)
    torch.testing.assert_close(torch.cat([prefill, decode]), want, atol=ATOL, rtol=0)


def test_model_with_split_o_proj_matches_hf(tmp_path, monkeypatch):
    """``o_splits``: each attention block's ``o_b_proj`` comes back as split-K partials (the
    split rule's size limits lowered to this tiny model), the residual updates add them, and
    the logits still match Hugging Face's."""
    import kvplan.models.deepseek_v4.attention as attn
    import kvplan.ops.split_linear as sl

    hf, model = saved_pair(tmp_path, 1)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setattr(sl, "SPLIT_LINEAR_MIN_WEIGHT", 0)
    monkeypatch.setattr(sl, "SPLIT_LINEAR_ROWS", (1, 128))
    calls = []
    monkeypatch.setattr(attn, "split_linear", lambda *a: calls.append(a[2]) or sl.split_linear(*a))
    model.set_o_splits(2)
    with pytest.raises(ValueError, match="splits must be an int >= 0"):
        model.set_o_splits(-1)
    ids = random_tokens(1, 11)
    family = ReferenceHybridFamily(model.config.layer_specs())
    with graph_safe_routing(model):
        (prefill,), _ = run_step(model, family, [(1, ids, 0, 9)])
        (decode,), _ = run_step(model, family, [(1, ids, 9, 2)])
    assert calls == [2] * (2 * model.config.num_layers)  # every layer, both steps
    torch.testing.assert_close(torch.cat([prefill, decode]), hf_logits(hf, ids), atol=ATOL, rtol=0)


# --- GPU ------------------------------------------------------------------------------------


def _gpu_block(dtype: torch.dtype):
    model = _model(
        2, "cuda", std=0.05, hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
        hc_mult=4, hc_sinkhorn_iters=20,
    )  # fmt: skip
    layer = model.layers[-1]  # a top-k routed layer (hash layers come first)
    hc, moe = layer.ffn_hc, layer.mlp
    if dtype != torch.float32:
        for p in moe.parameters():
            p.data = p.data.to(dtype)
    return hc, moe, layer.post_attention_layernorm


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernels_equal_torch_path(dtype):
    hc, moe, norm_w = _gpu_block(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(32, 4, 256, generator=gen, device="cuda").to(dtype)
    ids = torch.randint(0, 96, (32,), generator=gen, device="cuda")
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    with torch.no_grad():
        post, comb, x = hc(s)
        w_post, w_comb, w_x = hc_pre_torch(
            s, hc.fn, hc.base, hc.scale, iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps
        )
        torch.testing.assert_close(post, w_post, atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(comb, w_comb, atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(x, w_x, **tol)
        h = rms_norm(x, norm_w, hc.eps)
        torch.testing.assert_close(h, rms_norm_fp32w_torch(x, norm_w, hc.eps), **tol)
        r_ids, r_w, dense = moe.route_dense(h, ids)
        m = moe.experts_batched(h, dense, add=moe.shared(h))
        want_m = moe.experts_dense_loop(h, r_ids, r_w) + moe.shared(h)
        # bf16: the loop rounds after every expert, the batched sum once
        size = want_m.abs().max().item()
        m_tol = dict(atol=2e-5 * size, rtol=2e-5) if dtype == torch.float32 else dict(
            atol=1e-2 * size, rtol=1e-2)  # fmt: skip
        torch.testing.assert_close(m, want_m, **m_tol)
        torch.testing.assert_close(hyper_residual(s, post, comb, m),
                                   hc_post_torch(s, post, comb, m), **tol)  # fmt: skip


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    hc, moe, norm_w = _gpu_block(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    s = torch.randn(32, 4, 256, generator=gen, device="cuda").bfloat16()
    ids = torch.randint(0, 96, (32,), generator=gen, device="cuda")

    def block(s_in: torch.Tensor) -> torch.Tensor:
        post, comb, x = hc(s_in)
        return hyper_residual(s_in, post, comb, moe(rms_norm(x, norm_w, hc.eps), ids))

    static = s.clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), graph_safe_routing(moe):
            block(static)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static)
        for trial in range(2):
            fresh = torch.randn(s.shape, generator=gen, device="cuda").bfloat16()
            static.copy_(fresh)
            graph.replay()
            with graph_safe_routing(moe):
                want = block(fresh)
            # the same kernels; only a GEMM's algorithm choice may differ under capture
            torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2, msg=f"trial {trial}")


# --- fused hyper-connection chain -----------------------------------------------------------


@torch.no_grad()
def _unfused_logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """One prompt step with every connection and residual update called on its own."""
    from kvplan.backends.hybrid.api import HybridSeq
    from kvplan.models.deepseek_v4.layers import StepRope

    family = ReferenceHybridFamily(model.config.layer_specs())
    input_ids = torch.tensor(ids, dtype=torch.int64)
    pos = torch.arange(len(ids))
    ctx = family.plan([HybridSeq(1, 0, len(ids), ids, (), 0)], pos)
    x = model.embed_tokens(input_ids)
    s = x.unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()
    tables, eps = StepRope(pos, x.dtype), model.config.rms_norm_eps
    for layer in model.layers:
        post, comb, h = layer.attn_hc(s)
        s = hyper_residual(s, post, comb, layer.self_attn(rms_norm(h, layer.input_layernorm, eps),
                                                          ctx, tables))  # fmt: skip
        post, comb, h = layer.ffn_hc(s)
        m = layer.mlp(rms_norm(h, layer.post_attention_layernorm, eps), input_ids)
        s = hyper_residual(s, post, comb, m)
    h = rms_norm(model.hc_head(s), model.norm, eps)
    return torch.nn.functional.linear(h, model.head_weight()).float()


@pytest.mark.parametrize(
    "force_triton, fused_norm",
    [(False, False), (True, False), (True, True)],
    ids=["torch", "triton", "triton-fused-norm"],
)
def test_fused_connection_chain_equals_unfused(force_triton, fused_norm, monkeypatch):
    """The model chains each residual update into the next connection (`hc_post_pre`) and
    hands each block's input norm to the connection that forms the input; the logits equal
    calling every connection and norm on its own, bit for bit (torch path: the same ops;
    Triton: the fused kernels' exactness, with and without the norm inside ``hc_pre_kernel``,
    which the interpreter sums in the norm kernel's order)."""
    import kvplan.ops.hyper_connection as hcm

    monkeypatch.setattr(hcm, "FUSED_NORM", fused_norm)
    if force_triton:
        monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    model = _model(2)
    ids = random_tokens(5, 7)
    with graph_safe_routing(model):
        (got,), _ = run_step(model, ReferenceHybridFamily(model.config.layer_specs()),
                             [(1, ids, 0, 7)])  # fmt: skip
        want = _unfused_logits(model, ids)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_inference_path_equals_the_block_diagonal_product(dtype):
    """``GroupedLinear`` in inference writes its batched products straight into ``[T, g, m]``
    (no output copy): the same values as the autograd path and as the block-diagonal
    weight applied as one dense matrix."""
    from kvplan.models.deepseek_v4.attention import GroupedLinear

    gen = torch.Generator().manual_seed(3)
    g, n, m, t = 4, 24, 8, 7
    lin = GroupedLinear(n, g * m, g).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(g * m, n, generator=gen))
    x = torch.randn(t, g * n, generator=gen).to(dtype)
    with torch.no_grad():
        got = lin(x)
    assert got.shape == (t, g * m) and got.is_contiguous()
    assert torch.equal(got, lin(x).detach())  # the autograd path (copies the output)
    dense = torch.block_diag(*lin.weight.detach().float().unflatten(0, (g, m)))  # [g*m, g*n]
    torch.testing.assert_close(got.float(), x.float() @ dense.T, atol=1e-2, rtol=1e-2)
