"""DeepSeek-V4 weights: a folder written by Hugging Face's ``save_pretrained``, or random.

``save_pretrained`` writes DeepSeek's original tensor names (``attn.wq_a``, ``ffn.experts.3.w1``,
``hc_attn_fn`` ...), not the names of the transformers modules; both spellings are accepted
(with or without the ``model.`` prefix), mapping onto kvplan's parameters as follows
(per layer ``i``; ``a.`` = ``attn.`` / ``self_attn.``)::

    original                         transformers module                       kvplan
    a.wq_a / a.q_norm / a.wq_b       q_a_proj / q_a_norm / q_b_proj            self_attn.same
    a.wkv / a.norm / a.attn_sink     kv_proj / kv_norm / sinks                 self_attn.same
    a.wo_a / a.wo_b                  o_a_proj / o_b_proj                       self_attn.same
    a.compressor.{wkv,wgate,ape,norm} compressor.{kv_proj,gate_proj,position_bias,kv_norm}
    a.indexer.compressor.*           compressor.indexer.*                      self_attn.indexer.compressor.*
    a.indexer.wq_b / weights_proj    compressor.indexer.q_b_proj / scorer.weights_proj
    ffn.gate.weight / .bias / .tid2eid  mlp.gate.{weight,e_score_correction_bias,tid2eid}
    ffn.experts.E.w1 / w3 / w2       mlp.experts.gate_up_proj[E][:I] / [I:] / down_proj[E]
    ffn.shared_experts.w1 / w3 / w2  mlp.shared_experts.gate / up / down_proj  mlp.shared.*
    attn_norm / ffn_norm             input_layernorm / post_attention_layernorm
    hc_attn_{fn,base,scale} / hc_ffn_*  attn_hc.* / ffn_hc.*
    embed / head / norm / hc_head_*  embed_tokens / lm_head / norm / hc_head.*

Multi-token-prediction tensors (``mtp.*``) are skipped. Each checkpoint tensor is copied in
place into its parameter, so projections fused into one GEMM (`fuse_projections`) stay fused. Norm weights, sinks, position biases,
hyper-connection parameters and the router's correction bias stay fp32 whatever ``dtype``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvplan.models.deepseek_v4.config import DeepseekV4Config
from kvplan.models.deepseek_v4.layers import fuse_projections
from kvplan.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvplan.models.fp8_checkpoint import iter_checkpoint, read_quantization
from kvplan.models.weights import read_config_json

_ATTN = "(?:attn|self_attn)"
_FFN = "(?:ffn|mlp)"
# (regex over the name without "model." and "layers.{i}.", kvplan target)
_LAYER_NAMES = [
    (rf"{_ATTN}\.(?:wq_a|q_a_proj)\.weight", "self_attn.q_a_proj.weight"),
    (rf"{_ATTN}\.(?:q_norm|q_a_norm)\.weight", "self_attn.q_a_norm"),
    (rf"{_ATTN}\.(?:wq_b|q_b_proj)\.weight", "self_attn.q_b_proj.weight"),
    (rf"{_ATTN}\.(?:wkv|kv_proj)\.weight", "self_attn.kv_proj.weight"),
    (rf"{_ATTN}\.(?:norm|kv_norm)\.weight", "self_attn.kv_norm"),
    (rf"{_ATTN}\.(?:wo_a|o_a_proj)\.weight", "self_attn.o_a_proj.weight"),
    (rf"{_ATTN}\.(?:wo_b|o_b_proj)\.weight", "self_attn.o_b_proj.weight"),
    (rf"{_ATTN}\.(?:attn_sink|sinks)", "self_attn.sinks"),
    (rf"{_ATTN}\.(?:indexer\.compressor|compressor\.indexer)\.(?:wkv|kv_proj)\.weight",
     "self_attn.indexer.compressor.kv_proj.weight"),
    (rf"{_ATTN}\.(?:indexer\.compressor|compressor\.indexer)\.(?:wgate|gate_proj)\.weight",
     "self_attn.indexer.compressor.gate_proj.weight"),
    (rf"{_ATTN}\.(?:indexer\.compressor|compressor\.indexer)\.(?:ape|position_bias)",
     "self_attn.indexer.compressor.position_bias"),
    (rf"{_ATTN}\.(?:indexer\.compressor|compressor\.indexer)\.(?:norm|kv_norm)\.weight",
     "self_attn.indexer.compressor.kv_norm"),
    (rf"{_ATTN}\.(?:indexer|compressor\.indexer)\.(?:wq_b|q_b_proj)\.weight",
     "self_attn.indexer.q_b_proj.weight"),
    (rf"{_ATTN}\.(?:indexer|compressor\.indexer\.scorer)\.weights_proj\.weight",
     "self_attn.indexer.weights_proj.weight"),
    (rf"{_ATTN}\.compressor\.(?:wkv|kv_proj)\.weight", "self_attn.compressor.kv_proj.weight"),
    (rf"{_ATTN}\.compressor\.(?:wgate|gate_proj)\.weight", "self_attn.compressor.gate_proj.weight"),
    (rf"{_ATTN}\.compressor\.(?:ape|position_bias)", "self_attn.compressor.position_bias"),
    (rf"{_ATTN}\.compressor\.(?:norm|kv_norm)\.weight", "self_attn.compressor.kv_norm"),
    (rf"{_FFN}\.gate\.weight", "mlp.gate_weight"),
    (rf"{_FFN}\.gate\.tid2eid", "mlp.tid2eid"),
    (rf"{_FFN}\.gate\.(?:bias|e_score_correction_bias)", "mlp.e_score_correction_bias"),
    (rf"{_FFN}\.experts\.gate_up_proj", "mlp.gate_up"),
    (rf"{_FFN}\.experts\.down_proj", "mlp.down"),
    (rf"{_FFN}\.shared_experts\.(?:w1|gate_proj)\.weight", "mlp.shared.gate_proj.weight"),
    (rf"{_FFN}\.shared_experts\.(?:w3|up_proj)\.weight", "mlp.shared.up_proj.weight"),
    (rf"{_FFN}\.shared_experts\.(?:w2|down_proj)\.weight", "mlp.shared.down_proj.weight"),
    (r"(?:attn_norm|input_layernorm)\.weight", "input_layernorm"),
    (r"(?:ffn_norm|post_attention_layernorm)\.weight", "post_attention_layernorm"),
    (r"(?:hc_attn_|attn_hc\.)(fn|base|scale)", r"attn_hc.\1"),
    (r"(?:hc_ffn_|ffn_hc\.)(fn|base|scale)", r"ffn_hc.\1"),
]  # fmt: skip
_TOP_NAMES = [
    (r"(?:embed|embed_tokens)\.weight", "embed_tokens.weight"),
    (r"(?:head|lm_head)\.weight", "lm_head.weight"),
    (r"norm\.weight", "norm"),
    (r"(?:hc_head_|hc_head\.hc_)(fn|base|scale)", r"hc_head.hc_\1"),
]
_EXPERT = re.compile(rf"{_FFN}\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_FP32_KEEP = re.compile(r"(norm|sinks|position_bias|_hc\.|hc_head\.|e_score_correction_bias)")


def _skipped(name: str) -> bool:
    """Checkpoint tensors kvplan does not use (multi-token prediction, rotary tables)."""
    bare = name.removeprefix("model.")
    return bare.startswith("mtp.") or bare.endswith("inv_freq")


def _target(
    state: dict[str, torch.Tensor], moe_inter: int, name: str
) -> tuple[str, torch.Tensor] | None:
    """(kvplan name, destination view) that checkpoint tensor ``name`` fills; None = skip."""
    if _skipped(name):
        return None
    bare = name.removeprefix("model.")
    m = _LAYER.fullmatch(bare)
    table, rest, prefix = (_TOP_NAMES, bare, "") if m is None else (
        _LAYER_NAMES, m.group(2), f"layers.{m.group(1)}.")  # fmt: skip
    if m is not None and (e := _EXPERT.fullmatch(rest)) is not None:
        expert, which = int(e.group(1)), e.group(2)
        inter = moe_inter
        if which == "w2":
            return f"{prefix}mlp.down[{expert}]", state[f"{prefix}mlp.down"][expert]
        rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
        return f"{prefix}mlp.gate_up[{expert}]", state[f"{prefix}mlp.gate_up"][expert, rows]
    for pattern, repl in table:
        if re.fullmatch(pattern, rest):
            target = prefix + re.sub(pattern, repl, rest)
            if target not in state:
                raise ValueError(f"checkpoint tensor {name!r} maps to {target!r}, absent here")
            return target, state[target]
    raise ValueError(f"unexpected checkpoint tensor {name!r}")


@torch.no_grad()
def load_deepseek_v4(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DeepseekV4ForCausalLM:
    """The model stored in ``folder`` (``config.json`` + ``*.safetensors``), in ``dtype`` on
    ``device``; a fine-grained FP8 checkpoint (FP4 experts included) is dequantized as it is
    read (`kvplan.models.fp8_checkpoint`). Raises ValueError naming the file for an unknown,
    misshapen or missing tensor, and the field for an unsupported ``quantization_config``."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    raw = read_config_json(folder)
    if raw.get("model_type") != "deepseek_v4":
        raise ValueError(
            f"{cfg_path}: model_type must be 'deepseek_v4', got {raw.get('model_type')!r}"
        )
    quant = read_quantization(raw, cfg_path)
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(raw)).to(device)
    cast_model(model, dtype)
    files = sorted(folder.glob("*.safetensors"))
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    filled: dict[str, int] = {}
    for file_name, key, src in iter_checkpoint(folder, quant, skip=_skipped, device=device):
        hit = _target(state, model.config.moe_intermediate_size, key)
        if hit is None:
            continue
        target, dst = hit
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"{file_name}: tensor {key!r} has shape {tuple(src.shape)}, "
                f"{target!r} needs {tuple(dst.shape)}"
            )
        dst.copy_(src)
        base = target.split("[")[0]
        filled[base] = filled.get(base, 0) + src.numel()
    for name, t in state.items():
        if name.endswith("inv_freq"):
            continue
        if filled.get(name, 0) != t.numel():
            raise ValueError(
                f"{folder}: no tensor for {name!r} (checked {[p.name for p in files]})"
            )
    return model


def cast_model(model: DeepseekV4ForCausalLM, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
    """Cast the matrices to ``dtype`` in place; norms, sinks, position biases, hyper-connection
    parameters and the routers' correction bias stay fp32, integer buffers stay int64. The
    shared-input projections are fused again (`fuse_projections`)."""
    for name, p in model.named_parameters():
        if not _FP32_KEEP.search(name):
            p.data = p.data.to(dtype)
    return fuse_projections(model)


@torch.no_grad()
def init_random(
    model: DeepseekV4ForCausalLM, *, seed: int = 0, std: float = 0.02
) -> DeepseekV4ForCausalLM:
    """Random weights for tests and benchmarks, on the model's device: N(0, std) matrices,
    norms ``1 + N(0, 0.1)``, sinks N(0, 1) and position biases N(0, 0.5) (Hugging Face starts
    both at zero), hyper-connection bases N(0, 0.1) and scales ``1 + N(0, 0.1)``, correction
    biases N(0, 0.1), and ``tid2eid`` rows of distinct random experts."""
    dev = model.embed_tokens.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)

    def normal(t: torch.Tensor, mean: float, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, device=dev) * s + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf in ("scale", "hc_scale"):
            normal(p, 1.0, 0.1)
        elif leaf == "sinks":
            normal(p, 0.0, 1.0)
        elif leaf == "position_bias":
            normal(p, 0.0, 0.5)
        elif leaf in ("base", "hc_base"):
            normal(p, 0.0, 0.1)
        else:
            normal(p, 0.0, std)
    experts = model.config.n_routed_experts
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.0, 0.1)
        elif name.endswith("tid2eid"):
            keys = torch.rand((b.shape[0], experts), generator=gen, device=dev)
            b.copy_(keys.argsort(dim=-1)[:, : b.shape[1]])
    return fuse_projections(model)
