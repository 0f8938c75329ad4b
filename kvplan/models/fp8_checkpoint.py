"""Fine-grained FP8 checkpoints (with FP4-packed experts), dequantized as they load.

Many released checkpoints store their linear weights as float8 e4m3 codes with one scale per
block of the weight (``quantization_config: {"quant_method": "fp8", "weight_block_size":
[128, 128], ...}``: Qwen3 ``-FP8``, DeepSeek-V3 / V4), and DeepSeek-V4 stores its routed
experts as e2m1 FP4 pairs packed in a byte with one UE8M0 scale per 32 values along the input
dimension (``"expert_dtype": "fp4"``). kvplan's models hold full-precision weights, so a
quantized tensor is dequantized once, as it is read, into fp32 (exact: an e4m3 or e2m1 value
times a power of two, or times an fp32 scale, rounded once) and then copied into the model's
dtype like any other tensor. Activation scales (``activation_scheme: "static"``) are not
used: activations stay in the model's dtype, as with transformers' ``dequantize=True``.

Which tensors are quantized is read from the checkpoint, not from the config: a weight
``P.weight`` whose dtype is ``float8_e4m3fn`` (fp8) or ``int8`` / ``uint8`` /
``float4_e2m1fn_x2`` (two e2m1 codes a byte, the low nibble first) takes its scales from
``P.weight_scale_inv`` (transformers' name) or ``P.scale`` (DeepSeek's). The scale grid must
match the weight: fp8 weights ``[N, K]`` with ``weight_block_size [bn, bk]`` take a
``[ceil(N / bn), ceil(K / bk)]`` grid (the last block of a row or column may be partial) or a
single per-tensor scale; fp4 weights ``[N, K / 2]`` bytes take ``[N, ceil(K / 32)]``. Scales
may be fp32 / bf16 / fp16, ``float8_e8m0fnu`` or ``uint8`` UE8M0 exponents (``2^(byte -
127)``). Anything else in the checkpoint passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Fp8Checkpoint",
    "dequantize_fp4",
    "dequantize_fp8",
    "iter_checkpoint",
    "read_quantization",
]

# e2m1 code -> value (bit 3 is the sign)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_GROUP = 32  # values per scale along K in an FP4 weight
_SCALE_SUFFIXES = ("weight_scale_inv", "scale")
_ACTIVATION_SUFFIXES = ("input_scale", "activation_scale")
# safetensors dtype names of quantized weights
_FP8_CODES = ("F8_E4M3",)
_FP4_CODES = ("I8", "U8", "F4")  # F4: float4_e2m1fn_x2


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a checkpoint's ``quantization_config`` says about its weights."""

    block: tuple[int, int] | None  # weight_block_size; None: per-tensor scales
    expert_dtype: str = "fp8"  # "fp8" or "fp4" (DeepSeek-V4's routed experts)


def read_quantization(raw: dict[str, Any], path: str | Path) -> Fp8Checkpoint | None:
    """The checkpoint quantization of config dict ``raw`` (read from ``path``, named in
    errors): None when it has no ``quantization_config`` or one left by a GGUF conversion
    (``quant_method: "gguf"``: transformers writes it beside the dequantized tensors);
    ValueError naming the field and value for a method or setting kvplan does not load."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "gguf":  # a folder converted from GGUF (kvplan's own cache): dequantized
        return None
    if method != "fp8":
        raise ValueError(
            f"{where}.quant_method={method!r} is not supported: kvplan loads fine-grained FP8 "
            f"checkpoints ('fp8'), dequantized at load; dequantize others first"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt={fmt!r} is not supported (only 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}.activation_scheme={scheme!r} must be 'dynamic' or 'static'")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0", "float"):
        raise ValueError(f"{where}.scale_fmt={scale_fmt!r} must be 'ue8m0' or 'float'")
    block = qc.get("weight_block_size")
    if block is not None:
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ValueError(f"{where}.weight_block_size={block!r} must be two positive ints")
        block = (int(block[0]), int(block[1]))
    experts = qc.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
    if experts not in ("fp8", "fp4"):
        raise ValueError(f"{where}.expert_dtype={experts!r} must be 'fp8' or 'fp4'")
    return Fp8Checkpoint(block, experts)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from fp32 / bf16 / fp16, ``float8_e8m0fnu`` or ``uint8`` UE8M0 bytes."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu):
        return scale.to(torch.float32)
    raise ValueError(f"scales of dtype {scale.dtype} are not supported")


def _expand(scales: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """A ``[ceil(rows / bn), ceil(cols / bk)]`` grid spread over ``[rows, cols]``."""
    return scales.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str = "weight"
) -> torch.Tensor:
    """fp32 ``codes * scale`` for e4m3 ``codes [N, K]`` (or ``[E, N, K]``) and a block
    ``[ceil(N / bn), ceil(K / bk)]`` scale grid (one per leading index), or a single scale.
    ``name`` is the tensor named in errors."""
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: fp8 weights must be float8_e4m3fn, got {codes.dtype}")
    s = _scale_values(scale)
    values = codes.to(torch.float32)
    if s.numel() == 1:
        return values * s.reshape(())
    if block is None or codes.dim() < 2:
        raise ValueError(
            f"{name}: a scale grid of shape {tuple(scale.shape)} needs "
            f"quantization_config.weight_block_size (a 2-D weight with block scales)"
        )
    rows, cols = codes.shape[-2:]
    bn, bk = block
    want = (*codes.shape[:-2], -(-rows // bn), -(-cols // bk))
    if tuple(s.shape) != want:
        raise ValueError(
            f"{name}: weight of shape {tuple(codes.shape)} with blocks {list(block)} needs "
            f"scales of shape {want}, got {tuple(scale.shape)}"
        )
    gn, gk = want[-2:]
    flat_s = s.reshape(-1, gn, gk)
    flat_v = values.reshape(-1, rows, cols)
    if rows % bn == 0 and cols % bk == 0:  # whole blocks: a broadcast, no expanded scale grid
        blocks = flat_v.view(-1, gn, bn, gk, bk)
        return (blocks * flat_s[:, :, None, :, None]).reshape(values.shape)
    out = torch.stack([v * _expand(g, rows, cols, bn, bk) for v, g in zip(flat_v, flat_s)])
    return out.reshape(values.shape)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """fp32 weights ``[..., N, 2 * Kb]`` from e2m1 pairs ``packed [..., N, Kb]`` (int8 / uint8
    / float4_e2m1fn_x2; value ``2j`` in the low nibble of byte ``j``) and one scale per 32
    values along K: ``scale [..., N, ceil(2 * Kb / 32)]``."""
    if packed.dtype not in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        raise ValueError(f"{name}: fp4 weights must be int8 / uint8 bytes, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"{name}: fp4 weights must be [N, K / 2], got {tuple(packed.shape)}")
    codes = packed.contiguous().view(torch.uint8).to(torch.int64)
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    values = torch.stack([lut[codes & 0xF], lut[codes >> 4]], dim=-1).flatten(-2)
    rows, cols = values.shape[-2:]
    want = (*values.shape[:-1], -(-cols // FP4_GROUP))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{name}: fp4 weight of {cols} values a row needs scales of shape {want} (one per "
            f"{FP4_GROUP} values), got {tuple(scale.shape)}"
        )
    s = _scale_values(scale).repeat_interleave(FP4_GROUP, dim=-1)[..., :cols]
    return values * s


def _weight_of(key: str) -> str | None:
    """The weight key when ``key`` is named like a weight's scale or activation scale."""
    prefix, _, suffix = key.rpartition(".")
    if prefix and suffix in _SCALE_SUFFIXES + _ACTIVATION_SUFFIXES:
        return f"{prefix}.weight"
    return None


def iter_checkpoint(
    folder: str | Path,
    quant: Fp8Checkpoint | None,
    skip: Callable[[str], bool] | None = None,
    device: str | torch.device | None = None,
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(file name, key, tensor)`` of every tensor in ``folder``'s ``*.safetensors`` files
    (CPU), with quantized weights dequantized to fp32 under their own key and their scale /
    activation-scale tensors consumed. ``quant`` None: the tensors as stored, and a quantized
    weight is an error naming it (its config has no ``quantization_config``). Keys for which
    ``skip`` is true are not read (nor dequantized). ``device``: where quantized weights are
    multiplied out (and returned; a GPU does it far faster for a large checkpoint). Each file
    is opened once."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(folder)!r}")
    with ExitStack() as stack:
        opened = [(p, stack.enter_context(safe_open(str(p), framework="pt"))) for p in files]
        where = {key: (p, f) for p, f in opened for key in f.keys()}  # noqa: SIM118
        dtypes = {key: f.get_slice(key).get_dtype() for key, (_, f) in where.items()}

        def quantized(key: str) -> bool:
            """float8 codes, or bytes with a scale beside them (plain int8 tensors pass)."""
            dtype = dtypes.get(key, "")
            if dtype.startswith("F8_") and dtype != "F8_E8M0":
                return True
            base = key.removesuffix(".weight")
            return dtype in _FP4_CODES and any(f"{base}.{s}" in where for s in _SCALE_SUFFIXES)

        for path, f in opened:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if skip is not None and skip(key):
                    continue
                owner = _weight_of(key)
                if owner is not None and quantized(owner):
                    continue  # consumed with its weight
                if not quantized(key):
                    yield path.name, key, f.get_tensor(key)
                    continue
                if quant is None:
                    raise ValueError(
                        f"{path.name}: tensor {key!r} is quantized ({dtypes[key]}) but "
                        f"{folder / 'config.json'} has no quantization_config"
                    )
                yield path.name, key, _dequantize(where, dtypes[key], key, quant, device)


def _dequantize(where: dict, dtype: str, key: str, quant: Fp8Checkpoint, device) -> torch.Tensor:
    """``key``'s weight times its scales (``where``: key -> (file, open file))."""
    base = key.removesuffix(".weight")
    scale_key = next((f"{base}.{s}" for s in _SCALE_SUFFIXES if f"{base}.{s}" in where), None)
    name = f"{where[key][0].name}: tensor {key!r}"
    if dtype not in _FP8_CODES + _FP4_CODES:
        raise ValueError(f"{name} has dtype {dtype}; fp8 weights must be e4m3 (F8_E4M3)")
    if scale_key is None:
        raise ValueError(f"{name} is float8 but has no '{base}.weight_scale_inv' / '.scale'")
    codes = where[key][1].get_tensor(key)
    scale = where[scale_key][1].get_tensor(scale_key)
    if device is not None:
        codes, scale = codes.to(device), scale.to(device)
    if dtype in _FP8_CODES:
        return dequantize_fp8(codes, scale, quant.block, name)
    return dequantize_fp4(codes, scale, name)
