"""Model configuration for the Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) and
Gemma 3 (text).

`ModelConfig` is a frozen dataclass holding exactly what `kvplan.models.llama` and
`kvplan.models.gemma3` need. It is
built from a Hugging Face ``config.json`` (`ModelConfig.from_hf`) or from one of the named
random-weight configurations used by tests and ``kvplan bench`` (`named_config`).

The family differences are captured by five fields:

* ``qkv_bias``          -- Qwen2 has a bias on q/k/v projections;
* ``qk_norm``           -- Qwen3 applies a per-head RMSNorm to q and k before RoPE;
* ``layer_windows``     -- per layer: ``None`` (full attention) or the sliding window W
  (Mistral: every layer; Qwen2/3: the layers whose ``layer_types`` entry is
  ``"sliding_attention"``). A query at position p sees keys ``max(0, p - W + 1) .. p``,
  the same convention as Hugging Face's sliding-window mask (``k > p - W``);
* ``rope``              -- theta and the scaling rule (``default``, ``linear``, ``llama3``);
* ``tie_word_embeddings`` -- the LM head reuses the embedding matrix.

Gemma 3 (``model_type == "gemma3_text"``, served by `kvplan.models.gemma3`) adds:

* ``local_rope``            -- the RoPE of the sliding-window layers (``rope`` serves the
  full-attention ones);
* ``query_pre_attn_scalar`` -- attention scale ``query_pre_attn_scalar ** -0.5`` instead of
  ``head_dim ** -0.5``;
* ``hidden_act``            -- ``"gelu_pytorch_tanh"`` (the Llama family's is ``"silu"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

_ROPE_TYPES = ("default", "linear", "llama3")


LLAMA_FAMILY_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` values `ModelConfig.from_hf` maps onto the Llama-family model."""

GEMMA3_TYPES = ("gemma3_text",)
"""``model_type`` values served by the Gemma 3 text model (`kvplan.models.gemma3`)."""

_HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (Hugging Face ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, default_theta: float) -> RopeConfig:
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        kwargs: dict[str, Any] = {
            "theta": float(params.get("rope_theta", default_theta)),
            "rope_type": rope_type,
        }
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if params.get(key) is not None:
                kwargs[key] = float(params[key])
        if params.get("original_max_position_embeddings") is not None:
            kwargs["original_max_position_embeddings"] = int(
                params["original_max_position_embeddings"]
            )
        return cls(**kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and family switches of a Llama-family decoder.

    Example::

        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_layers=2, num_heads=4, num_kv_heads=2)
        cfg.head_dim  # 16
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim_override: int | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    local_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"num_heads and num_kv_heads must be > 0, got {self.num_heads}, {self.num_kv_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim_override is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                "when head_dim is not given"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.num_layers:
                raise ValueError(
                    f"layer_windows has {len(self.layer_windows)} entries, "
                    f"expected num_layers={self.num_layers}"
                )
            for w in self.layer_windows:
                if w is not None and w <= 0:
                    raise ValueError(f"sliding window must be > 0 or None, got {w}")
        if self.hidden_act not in _HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {_HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ValueError(
                f"query_pre_attn_scalar must be > 0 or None, got {self.query_pre_attn_scalar}"
            )

    @property
    def is_gemma3(self) -> bool:
        """Served by `kvplan.models.gemma3` (else by `kvplan.models.llama`)."""
        return self.model_type in GEMMA3_TYPES

    @property
    def attn_scale(self) -> float:
        """Softmax scale of the attention logits."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def rope_of_layer(self, layer_idx: int) -> RopeConfig:
        """RoPE of ``layer_idx``: ``local_rope`` for sliding-window layers when set."""
        if self.local_rope is not None and self.windows[layer_idx] is not None:
            return self.local_rope
        return self.rope

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.hidden_size // self.num_heads

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Sliding window of every layer (``None`` = full attention)."""
        return self.layer_windows or (None,) * self.num_layers

    @property
    def num_params(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """From a ``transformers`` config object or a ``config.json`` dict."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        model_type = d.get("model_type", "llama")
        if model_type not in LLAMA_FAMILY_TYPES + GEMMA3_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; kvplan serves "
                f"{LLAMA_FAMILY_TYPES + GEMMA3_TYPES} and 'deepseek_v4'"
            )
        if model_type in GEMMA3_TYPES:
            return cls._gemma3_from_hf(d)
        num_layers = int(d["num_hidden_layers"])
        rope = RopeConfig.from_hf(
            d.get("rope_parameters") or d.get("rope_scaling"), float(d.get("rope_theta", 10000.0))
        )
        window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if window is None:
            windows = None
        elif layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        elif model_type in ("qwen2", "qwen3"):
            use = d.get("use_sliding_window", False)
            first_full = int(d.get("max_window_layers", num_layers))
            windows = tuple(window if use and i >= first_full else None for i in range(num_layers))
        else:
            windows = (int(window),) * num_layers
        if windows is not None and all(w is None for w in windows):
            windows = None
        qkv_bias = bool(d.get("attention_bias") or model_type == "qwen2")
        return cls(
            **_shared_fields(d),
            rope=rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            layer_windows=windows,
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            model_type=model_type,
        )

    @classmethod
    def _gemma3_from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """A ``gemma3_text`` config dict: per-layer-type RoPE, query scale, gelu-tanh MLP."""
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None:
                raise ValueError(f"{key} = {d[key]} is not supported (kvplan needs None)")
        for key in ("use_bidirectional_attention", "attention_bias"):
            if d.get(key):
                raise ValueError(f"{key} = {d[key]} is not supported for gemma3_text")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        num_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types") or ["full_attention"] * num_layers
        window = d.get("sliding_window")
        windows = tuple(
            int(window) if t == "sliding_attention" and window is not None else None
            for t in layer_types
        )
        params = d.get("rope_parameters") or {}
        legacy_theta = float(d.get("rope_theta", 1000000.0))
        if "full_attention" in params or "sliding_attention" in params:
            rope = RopeConfig.from_hf(params.get("full_attention"), legacy_theta)
            local = RopeConfig.from_hf(
                params.get("sliding_attention"), float(d.get("rope_local_base_freq", 10000.0))
            )
        else:
            rope = RopeConfig.from_hf(params or d.get("rope_scaling"), legacy_theta)
            local = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))
        return cls(
            **_shared_fields(d),
            rope=rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            qk_norm=True,
            layer_windows=None if all(w is None for w in windows) else windows,
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            model_type="gemma3_text",
            local_rope=local,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            hidden_act=act,
        )


def _shared_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields every supported ``config.json`` spells the same way: sizes,
    heads, norm epsilon, BOS / EOS ids."""
    num_heads = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim_override=d.get("head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


# Named random-weight configurations for tests and benchmarks.
_NAMED: dict[str, ModelConfig] = {
    # The engine benchmark's 1.2B model (Llama 3.2 1B shapes).
    "llama-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        model_type="llama",
    ),
    # Qwen3-0.6B shapes: q/k norm, head_dim 128, tied embeddings.
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim_override=128,
        rope=RopeConfig(theta=1000000.0),
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=40960,
        model_type="qwen3",
    ),
    "tiny-mistral": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim_override=16,
        layer_windows=(32, 32),
        model_type="mistral",
    ),
    "tiny-llama": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim_override=16,
    ),
}


def named_config(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration (``llama-1b``, ``qwen3-0.6b``, ``tiny-llama``, ``tiny-mistral``),
    with field overrides."""
    if name not in _NAMED:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(_NAMED)}")
    return replace(_NAMED[name], **overrides)


def named_configs() -> list[str]:
    return sorted(_NAMED)
