"""The DeepSeek-V4 causal LM over a flat batch, attending through a hybrid family context.

`DeepseekV4ForCausalLM.forward(input_ids, positions, ctx, logits_indices)` runs one engine
step: rows ``[T]`` of every scheduled sequence back to back; the hybrid family's context
``ctx`` (`kvplan.backends.hybrid.api.HybridStepContext`) owns every cache and decides what each
row attends. Everything with weights runs here, token by token::

    s = embed(input_ids) copied to hc_mult streams              # [T, n, hidden]
    per layer:  s = mHC(s, attention(input_layernorm(.)))
                s = mHC(s, moe(post_attention_layernorm(.), input_ids))
    (each residual update runs fused with the connection that follows it)
    logits = lm_head(norm(hyper_head(s)))[logits_indices]       # fp32 [N, vocab]

Example (one prompt through the reference family)::

    model = init_random(DeepseekV4ForCausalLM(cfg), seed=0)
    family = ReferenceHybridFamily(cfg.layer_specs())
    ids = torch.tensor([5, 7, 9]); pos = torch.arange(3)
    ctx = family.plan([HybridSeq(0, 0, 3, ids.tolist(), (), 0)], pos)
    logits = model(ids, pos, ctx, torch.tensor([2]))          # [1, vocab]
"""

from __future__ import annotations

import torch
from torch import nn

from kvplan._checks import check_tensor
from kvplan.backends.hybrid.api import HybridStepContext
from kvplan.models.deepseek_v4.attention import DeepseekV4Attention
from kvplan.models.deepseek_v4.config import DeepseekV4Config
from kvplan.models.deepseek_v4.hyper import HyperConnection, HyperHead, hyper_residual
from kvplan.models.deepseek_v4.layers import Rope, StepRope, fuse_projections
from kvplan.models.deepseek_v4.moe import DeepseekV4MoE
from kvplan.ops.small_gemm import small_linear


class DeepseekV4DecoderLayer(nn.Module):
    """Attention and MoE blocks, each wrapped in its hyper-connection."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int, rope: Rope) -> None:
        super().__init__()
        c = config
        self.eps = c.rms_norm_eps
        self.self_attn = DeepseekV4Attention(c, layer_idx, rope)
        self.mlp = DeepseekV4MoE(c, layer_idx)
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size, dtype=torch.float32))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size, dtype=torch.float32))
        hc = (c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self,
        s: torch.Tensor,
        input_ids: torch.Tensor,
        ctx: HybridStepContext,
        tables: StepRope | None = None,
    ) -> torch.Tensor:
        """``s``: ``[T, n, hidden]`` -> ``[T, n, hidden]``; ``tables``: the step's rotary
        tables (`StepRope`, shared by the layers; computed by the attention when None)."""
        return self.run(s, None, input_ids, ctx, tables, None)[0]

    def attn_norm(self) -> tuple[torch.Tensor, float]:
        """The attention block's input norm as a connection takes it (`hc_pre`'s ``norm``)."""
        return self.input_layernorm, self.eps

    def run(
        self,
        s: torch.Tensor,
        pre: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        input_ids: torch.Tensor,
        ctx: HybridStepContext,
        tables: StepRope | None,
        nxt: DeepseekV4DecoderLayer | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """`forward` with the hyper-connections chained across layers.

        ``pre``: ``self.attn_hc(s, self.attn_norm())`` when the caller already has it (None:
        computed here); ``nxt``: the layer after this one (None: none). Returns (``s'``,
        ``nxt.attn_hc(s', nxt.attn_norm())`` or None); every residual update that a
        connection follows runs fused with it (`HyperConnection.post_pre`), and each block's
        input norm with the connection that forms the input.
        """
        post, comb, h = self.attn_hc(s, self.attn_norm()) if pre is None else pre
        a = self.self_attn(h, ctx, tables)
        ffn_norm = (self.post_attention_layernorm, self.eps)
        s, post, comb, h = self.ffn_hc.post_pre(s, post, comb, a, ffn_norm)
        m = self.mlp(h, input_ids)
        if nxt is None:
            return hyper_residual(s, post, comb, m), None
        s, post, comb, h = nxt.attn_hc.post_pre(s, post, comb, m, nxt.attn_norm())
        return s, (post, comb, h)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 (without its multi-token-prediction layers). Parameters start uninitialised
    or at HF's constant defaults: fill them with `load_deepseek_v4` or `init_random`.

    Projections that share an input (`kvplan.models.deepseek_v4.layers.LinearGroup`) are fused
    at construction and again after every ``.to()`` / ``.cuda()`` (and by `cast_model`):
    their weights are views of one tensor each group, and in-place writes keep them so. A
    weight replaced any other way makes its group run unfused until `fuse_projections`."""

    # False: return the logits in the model's dtype, skipping the fp32 copy of the whole
    # ``[N, V]`` output (the engine sets it: its sampling and logprobs widen what they read)
    float_logits: bool = True

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        c = config
        self.config = c
        self.main_rope = Rope(c.main_rope, c.rope_head_dim)
        self.compress_rope = Rope(c.compress_rope, c.rope_head_dim)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(c, i, self.main_rope if c.ratio(i) == 0 else self.compress_rope)
            for i in range(c.num_layers)
        )
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps)
        self.norm = nn.Parameter(torch.ones(c.hidden_size, dtype=torch.float32))
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        )
        fuse_projections(self)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ...), then re-fuse the projections
        whose weights it replaced."""
        super()._apply(fn, recurse)
        return fuse_projections(self)

    def set_o_splits(self, splits: int) -> None:
        """Every attention block's ``o_splits``: ``o_b_proj`` of decode-sized steps on the
        Triton path as ``splits`` split-K fp32 partials (`kvplan.ops.split_linear`), which the
        residual update after the block adds up; 0 = the plain GEMM. CUDA graphs keep the
        setting they were captured with."""
        if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
            raise ValueError(f"splits must be an int >= 0, got {splits!r}")
        for layer in self.layers:
            layer.self_attn.o_splits = splits

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: HybridStepContext,
        logits_indices: torch.Tensor | None = None,
        *,
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step.

        Args:
            input_ids: int64 ``[T]`` token ids of the step's rows.
            positions: int64 ``[T]`` absolute positions (the same tensor as ``ctx.positions``).
            ctx: the hybrid family's context for this step.
            logits_indices: int64 ``[N]`` rows whose logits to return (None = every row).
            argmax_out: optional int64 ``[N]`` (``[T]`` without ``logits_indices``) on the
                model device, filled with the greedy tokens ``logits.argmax(-1)`` (fused into
                the LM head where `kvplan.ops.small_gemm.small_linear` runs its kernel).
        Returns:
            fp32 logits ``[N, vocab]`` (``[T, vocab]`` when ``logits_indices`` is None; the
            model's dtype without ``float_logits``).
        """
        dev = self.embed_tokens.weight.device
        t = check_tensor("input_ids", input_ids, dtype=torch.int64, ndim=1, device=dev).shape[0]
        check_tensor("positions", positions, dtype=torch.int64, shape=(t,), device=dev)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        s = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, n, hidden]
        tables = StepRope(positions, x.dtype)  # each rotary table computed once per step
        pre = None  # the next layer's attention connection, fused into the residual update
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            s, pre = layer.run(s, pre, input_ids, ctx, tables, nxt)
        if logits_indices is not None:
            check_tensor("logits_indices", logits_indices, dtype=torch.int64, ndim=1, device=dev)
            s = s[logits_indices]
        h = self.hc_head(s, (self.norm, self.config.rms_norm_eps))  # the final norm fused
        logits = small_linear(h, self.head_weight(), argmax_out)
        return logits.float() if self.float_logits else logits
