"""DeepSeek-V4 configuration: a frozen, validated view of a Hugging Face ``config.json``.

`DeepseekV4Config.from_hf(d)` accepts the dict that ``save_pretrained`` writes (``model_type``
``"deepseek_v4"``) or a ``transformers.DeepseekV4Config``. Fields missing from the dict take
Hugging Face's defaults, including its fallbacks: ``layer_types`` from the legacy per-layer
``compress_ratios`` (0 / 4 / 128) or, absent both, two HCA layers then CSA / HCA alternating;
``mlp_layer_types`` = ``num_hash_layers`` (default 3) ``"hash_moe"`` layers then ``"moe"``;
``partial_rotary_factor`` = ``qk_rope_head_dim / head_dim`` (default 64 / 512).

Two RoPE tables exist (`RopeSpec`): ``"main"`` (``rope_theta``, plain) serves the sliding
layers; ``"compress"`` (``compress_rope_theta``, optionally YaRN-scaled) serves every CSA / HCA
layer (its queries, its raw K=V rows, its compressed entries and the indexer).

Surprising Hugging Face details this config reproduces:

* ``n_shared_experts`` is not a width multiplier: HF builds one shared MLP of
  ``moe_intermediate_size`` whatever the count (we accept only 1);
* ``norm_topk_prob`` is ignored: the routed weights are always renormalised;
* ``scoring_func`` ``"softmax"`` is named in HF's docstring but has no activation there (HF
  fails on it); only ``sqrtsoftplus`` and ``sigmoid`` are accepted;
* YaRN's ``truncate`` is read from the *top-level* ``rope_parameters`` (which only holds
  ``main`` / ``compress``), so it is always True; a flat (non-nested) ``rope_parameters`` gets
  ``attention_factor = 1.0`` forced onto its YaRN ``compress`` table, a nested one computes it
  from ``factor`` / ``mscale`` when absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvplan.backends.hybrid.api import LAYER_KINDS, HybridLayerSpec

MLP_KINDS = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
_ROPE_TYPES = ("default", "yarn")
_LEGACY_RATIO_KINDS = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table over the trailing ``rope_head_dim`` channels (interleaved pairs).

    ``rope_type`` ``"default"``: ``inv_freq[i] = theta ** (-2i / d)``; ``"yarn"``: blend of
    ``inv_freq`` and ``inv_freq / factor`` over a ramp between the correction dims of
    ``beta_fast`` / ``beta_slow`` rotations at ``original_max_position_embeddings``; cos / sin
    are multiplied by ``attention_factor``.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.rope_type == "yarn":
            if not self.factor >= 1.0:
                raise ValueError(f"yarn factor must be >= 1, got {self.factor}")
            if self.original_max_position_embeddings < 1:
                raise ValueError(
                    "yarn original_max_position_embeddings must be >= 1, got "
                    f"{self.original_max_position_embeddings}"
                )

    @classmethod
    def from_hf(cls, params: dict[str, Any], *, default_theta: float) -> RopeSpec:
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        theta = float(params.get("rope_theta", default_theta))
        if rope_type != "yarn":
            return cls(theta=theta, rope_type=rope_type)
        if params.get("factor") is None:
            raise ValueError("rope_parameters: a yarn table needs 'factor'")
        factor = float(params["factor"])
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor, 1.0)
        return cls(
            theta=theta,
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 0)),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
        )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class DeepseekV4Config:
    """Everything the kvplan DeepSeek-V4 model needs; validated on construction.

    Per-layer schedules are tuples of length ``num_layers``; ``csa_ratio`` / ``hca_ratio`` are
    HF's ``compress_rates``. ``rope_head_dim`` is the trailing rotary slice of every head.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    sliding_window: int
    csa_ratio: int
    hca_ratio: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeSpec
    compress_rope: RopeSpec
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        positive = [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "index_topk",
            "index_n_heads",
            "index_head_dim",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("csa_ratio", "hca_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (compress_rates) must be >= 1, got {getattr(self, name)}")
        for name, kinds, allowed in (
            ("layer_types", self.layer_types, LAYER_KINDS),
            ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS),
        ):
            if len(kinds) != self.num_layers:
                raise ValueError(
                    f"{name} has {len(kinds)} entries, num_hidden_layers is {self.num_layers}"
                )
            bad = [k for k in kinds if k not in allowed]
            if bad:
                raise ValueError(f"{name} entries must be in {allowed}, got {bad}")
        if not (0 < self.rope_head_dim <= self.head_dim) or self.rope_head_dim % 2:
            raise ValueError(
                f"rope_head_dim (head_dim * partial_rotary_factor) must be even and in "
                f"(0, head_dim={self.head_dim}], got {self.rope_head_dim}"
            )
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= rope_head_dim "
                f"({self.rope_head_dim}): indexer rows carry the same rotary slice"
            )
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"o_groups ({self.o_groups}) must divide num_attention_heads * head_dim "
                f"({self.num_heads * self.head_dim})"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )

    def ratio(self, layer_idx: int) -> int:
        """Compression ratio of layer ``layer_idx`` (0 for a sliding layer)."""
        kind = self.layer_types[layer_idx]
        if kind == "compressed_sparse_attention":
            return self.csa_ratio
        return self.hca_ratio if kind == "heavily_compressed_attention" else 0

    def rope(self, layer_idx: int) -> RopeSpec:
        """The rotary table of layer ``layer_idx``: main for sliding, compress otherwise."""
        return (
            self.main_rope
            if self.layer_types[layer_idx] == "sliding_attention"
            else self.compress_rope
        )

    def layer_specs(self) -> list[HybridLayerSpec]:
        """One `HybridLayerSpec` per layer, as the hybrid attention family needs them."""
        specs = []
        for i, kind in enumerate(self.layer_types):
            csa = kind == "compressed_sparse_attention"
            specs.append(
                HybridLayerSpec(
                    kind=kind,
                    window=self.sliding_window,
                    ratio=self.ratio(i),
                    top_k=self.index_topk if csa else 0,
                    head_dim=self.head_dim,
                    index_head_dim=self.index_head_dim if csa else 0,
                    num_heads=self.num_heads,
                    num_index_heads=self.index_n_heads if csa else 0,
                )
            )
        return specs

    @classmethod
    def from_hf(cls, hf: Any) -> DeepseekV4Config:
        """From a ``config.json`` dict or a ``transformers.DeepseekV4Config``."""
        d = dict(hf if isinstance(hf, dict) else hf.to_dict())
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type must be 'deepseek_v4', got {d.get('model_type')!r}")
        for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1)):
            if d.get(key, want) != want:
                raise ValueError(f"{key} must be {want} for DeepSeek-V4, got {d[key]!r}")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{key}=True is not supported for DeepSeek-V4")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {d['hidden_act']!r}")
        n = int(d.get("num_hidden_layers", 43))
        head_dim = int(d.get("head_dim", 512))
        rates = dict(_DEFAULT_RATES)
        rates.update(d.get("compress_rates") or {})
        for legacy, kind in (
            ("compress_rate_csa", "compressed_sparse_attention"),
            ("compress_rate_hca", "heavily_compressed_attention"),
        ):
            if d.get(legacy) is not None:
                rates[kind] = d[legacy]
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_LEGACY_RATIO_KINDS[r] for r in d["compress_ratios"]]
            except KeyError as e:
                raise ValueError(f"compress_ratios entries must be 0, 4 or 128, got {e}") from None
        if layer_types is None:
            tail = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n - 2, 0))]  # fmt: skip
            layer_types = ["heavily_compressed_attention"] * min(n, 2) + tail
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            num_hash = d.get("num_hash_layers")
            num_hash = 3 if num_hash is None else int(num_hash)
            mlp_types = ["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash)
        prf = d.get("partial_rotary_factor")
        if prf is None:
            rope_dim = d.get("qk_rope_head_dim")
            prf = rope_dim / head_dim if rope_dim is not None else 64 / 512
        rope_theta = float(d.get("rope_theta", 10000.0))
        compress_theta = float(d.get("compress_rope_theta", 160000.0))
        rope_params = d.get("rope_parameters") or {}
        for label in ("main", "compress"):
            sub = rope_params.get(label)
            if isinstance(sub, dict) and sub.get("partial_rotary_factor", prf) != prf:
                raise ValueError(
                    f"rope_parameters[{label!r}].partial_rotary_factor "
                    f"({sub['partial_rotary_factor']}) differs from partial_rotary_factor ({prf})"
                )
        main_rope, compress_rope = _ropes(rope_params, rope_theta, compress_theta)
        return cls(
            vocab_size=int(d.get("vocab_size", 129280)),
            hidden_size=int(d.get("hidden_size", 4096)),
            num_layers=n,
            num_heads=int(d.get("num_attention_heads", 64)),
            head_dim=head_dim,
            rope_head_dim=int(head_dim * float(prf)),
            q_lora_rank=int(d.get("q_lora_rank", 1024)),
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            sliding_window=int(d.get("sliding_window", 128)),
            csa_ratio=int(rates["compressed_sparse_attention"]),
            hca_ratio=int(rates["heavily_compressed_attention"]),
            index_topk=int(d.get("index_topk", 512)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            n_routed_experts=int(d.get("n_routed_experts", 256)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 2048)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )


def _ropes(
    rp: dict[str, Any], rope_theta: float, compress_theta: float
) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress) tables from HF's nested ``{"main", "compress"}`` or flat parameters."""
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main = RopeSpec.from_hf(rp["main"], default_theta=rope_theta)
        return main, RopeSpec.from_hf(rp["compress"], default_theta=compress_theta)
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    flat["rope_theta"] = compress_theta
    if flat.get("rope_type", flat.get("type")) == "yarn":
        flat.setdefault("attention_factor", 1.0)
    return RopeSpec(theta=rope_theta), RopeSpec.from_hf(flat, default_theta=compress_theta)
