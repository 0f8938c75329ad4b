"""Weights: Hugging Face folders, GGUF files (through transformers) and random initialisation.

Hugging Face parameter names map onto the fused kvplan layout::

    model.layers.{i}.self_attn.q_proj.weight  -> layers.{i}.self_attn.qkv_proj.weight[0 : Hq*D]
    model.layers.{i}.self_attn.k_proj.weight  -> ... [Hq*D : Hq*D + Hkv*D]
    model.layers.{i}.self_attn.v_proj.weight  -> ... [Hq*D + Hkv*D : Hq*D + 2*Hkv*D]
    model.layers.{i}.mlp.gate_proj.weight     -> layers.{i}.mlp.gate_up_proj.weight[0 : I]
    model.layers.{i}.mlp.up_proj.weight       -> layers.{i}.mlp.gate_up_proj.weight[I : 2I]
    model.embed_tokens.weight / model.norm.weight / lm_head.weight -> embed_tokens / norm / lm_head

(biases of q/k/v likewise; every other name drops the ``model.`` prefix).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvplan.models.config import ModelConfig
from kvplan.models.fp8_checkpoint import iter_checkpoint, read_quantization
from kvplan.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, int, int] | None:
    """(parameter, row start, row end) that HF tensor ``name`` fills; None = ignored name."""
    cfg = model.config
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in ("lm_head.weight",):
        if model.lm_head is None:
            return None  # tied: the embedding matrix is the head
        return model.lm_head.weight, 0, cfg.vocab_size
    plain = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if name in plain:
        p = plain[name]
        return p, 0, p.shape[0]
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected weight name {name!r}")
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    q, kv, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    attn = layer.self_attn
    sliced = {
        "self_attn.q_proj": (attn.qkv_proj, 0, q),
        "self_attn.k_proj": (attn.qkv_proj, q, q + kv),
        "self_attn.v_proj": (attn.qkv_proj, q + kv, q + 2 * kv),
        "mlp.gate_proj": (layer.mlp.gate_up_proj, 0, inter),
        "mlp.up_proj": (layer.mlp.gate_up_proj, inter, 2 * inter),
    }
    module_name, _, kind = rest.rpartition(".")
    if module_name in sliced:
        module, start, end = sliced[module_name]
        return getattr(module, kind), start, end
    p = layer.get_parameter(rest)
    return p, 0, p.shape[0]


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``model`` (casting to its dtype and device).

    Raises ValueError on an unknown name, a shape mismatch, or a parameter left unfilled.
    """
    filled: dict[int, int] = {}
    for name, tensor in weights:
        hit = _target(model, name)
        if hit is None:
            continue
        param, start, end = hit
        dst = param.data[start:end]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        filled[id(param)] = filled.get(id(param), 0) + (end - start)
    for pname, param in model.named_parameters():
        if filled.get(id(param), 0) != param.shape[0]:
            raise ValueError(f"parameter {pname!r} was not (fully) loaded from the checkpoint")


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` with N(0, std) matrices, zero biases and unit norms (on its device)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every ``*.safetensors`` file in ``folder`` (CPU tensors); a
    fine-grained FP8 checkpoint's weights come dequantized to fp32
    (`kvplan.models.fp8_checkpoint`)."""
    quant = None
    if (Path(folder) / "config.json").is_file():
        quant = read_quantization(read_config_json(folder), Path(folder) / "config.json")
    for _, key, tensor in iter_checkpoint(folder, quant):
        yield key, tensor


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; ``ValueError`` naming the file when it is missing,
    not JSON, or not a JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in model folder {str(folder)!r}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config must be a JSON object, got {type(raw).__name__}")
    return raw


def read_hf_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    raw = read_config_json(folder)
    try:
        return ModelConfig.from_hf(raw)
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{path}: {detail}") from exc


def load_gguf_state(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    """Dequantize a GGUF checkpoint with transformers: (config, fp32 state dict, hf config)."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32
        )
    except Exception as exc:  # truncated or foreign files fail deep inside the GGUF reader
        raise ValueError(f"{p}: not a readable GGUF model ({type(exc).__name__}: {exc})") from exc
    try:
        return ModelConfig.from_hf(hf.config), hf.state_dict(), hf.config
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{p}: {exc}") from exc
