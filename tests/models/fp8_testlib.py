"""Writers of fine-grained FP8 checkpoints for the loader tests (the test side's own
quantizers, independent of `kvplan.models.fp8_checkpoint`):

* `quantize_fp8(w, block, ue8m0)` -- e4m3 codes and one scale per block (UE8M0 powers of two
  as ``float8_e8m0fnu``, or fp32 ``amax / 448``), partial last blocks included;
* `quantize_fp4(w)` -- e2m1 codes packed two a byte (low nibble first) as int8, one UE8M0
  scale per 32 values of a row;
* `write_quantized(src, dst, rules, quantization_config)` -- a copy of a ``save_pretrained``
  folder whose tensors matching ``rules`` are replaced by codes and a scale tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp8(
    w: torch.Tensor, block: tuple[int, int], ue8m0: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes ``[N, K]``, scales ``[ceil(N / bn), ceil(K / bk)]``) of a 2-D weight."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float()
    amax = padded.view(gn, bn, gk, bk).abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    codes = (w.float() / full).to(torch.float8_e4m3fn)
    return codes, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K / 2]`` packed e2m1 pairs, ``float8_e8m0fnu`` scales ``[N, K / 32]``)."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2((groups.abs().amax(-1) / 6.0).clamp_min(1e-30))))
    x = groups / scale[..., None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.view(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def write_quantized(
    src: Path,
    dst: Path,
    rules: list[tuple[str, str]],
    quantization_config: dict,
    *,
    scale_suffix: str = "scale",
    block: tuple[int, int] = (128, 128),
    ue8m0: bool = True,
) -> dict[str, torch.Tensor]:
    """Write ``dst`` = ``src`` with each tensor whose name matches a rule's regex stored as
    ``"fp8"`` or ``"fp4"`` (the rule's format) plus ``<prefix>.<scale_suffix>``; returns the
    tensors written."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        fmt = next((f for pattern, f in rules if re.search(pattern, name)), None)
        if fmt is None:
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        codes, scale = quantize_fp8(t, block, ue8m0) if fmt == "fp8" else quantize_fp4(t)
        out[name] = codes
        out[f"{prefix}.{scale_suffix}"] = scale
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in src.iterdir():  # tokenizer / generation files
        if extra.suffix != ".safetensors" and extra.name != "config.json":
            (dst / extra.name).write_bytes(extra.read_bytes())
    return out
