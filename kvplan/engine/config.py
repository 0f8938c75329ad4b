"""`EngineConfig`: every engine setting, its default and its validation, in one place.

`kvplan.LLM`, `kvplan.engine.builder.build_engine`, ``kvplan generate``, ``kvplan bench`` and
``bench/bench_engine.py`` all take one `EngineConfig`; the command lines derive their engine
flags from its fields (`add_engine_arguments`, `config_from_args`), so a setting is declared,
documented and checked once.

Example::

    cfg = EngineConfig(backend="ragged", block_size=8, max_num_seqs=16)
    llm = LLM("random:tiny-llama", config=cfg)      # or LLM(..., backend="ragged", ...)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplan.backends import BACKEND_NAMES
from kvplan.cache.kv_tensors import KV_FORMATS as STORED_KV_FORMATS
from kvplan.cache.kv_tensors import QUANTIZED_KV_FORMATS

KV_FORMATS = ("auto", *STORED_KV_FORMATS)
SLIDING_WINDOW_KV = ("window", "full")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# the KV format "auto" picks for each model dtype
_AUTO_KV_FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DEFAULT_MAX_MODEL_LEN = 4096  # cap of the default max_model_len
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # bytes
DEFAULT_CUDA_KV_CACHE_SHARE = 0.6  # of the free device memory


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (each field's ``help`` is also its command-line help).

    Raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of
    range, naming the field and the value. Settings that depend on the model (the default
    ``max_model_len``, an ``fp8`` KV cache's head-size rule) are resolved by the builder.
    """

    device: str | torch.device | None = _doc(
        'where the model runs: "cuda" when available, else "cpu"', None
    )
    dtype: str | torch.dtype | None = _doc(
        "model dtype (float32/bfloat16/float16; default fp32 on CPU, bf16 on CUDA)", None
    )
    backend: str = _doc(f"attention backend, one of {BACKEND_NAMES}", "block_offsets")
    kv_format: str = _doc(
        f'KV cache format, one of {KV_FORMATS}; "auto" = the model dtype. "fp8" is e4m3 with '
        'per-32-value fp32 scales (DeepSeek-V4: UE8M0); "int8" symmetric int8 with per-32-value '
        'fp32 scales; "fp4" e2m1 with per-16-value e4m3 scales',
        "auto",
    )
    block_size: int = _doc("tokens per KV block", 16)
    max_num_batched_tokens: int = _doc("token budget of one step (chunked prefill + decode)", 512)
    max_num_seqs: int = _doc("most requests in one step", 64)
    max_model_len: int | None = _doc(
        f"longest prompt + max_tokens (default: min({DEFAULT_MAX_MODEL_LEN}, the model's limit))",
        None,
    )
    num_blocks: int | None = _doc(
        "KV blocks of the full-attention pool; a sliding-window pool gets at most this, sized "
        "for window_pool_seqs sequences (default: sized from kv_cache_memory)",
        None,
    )
    kv_cache_memory: int | None = _doc(
        "bytes for the KV cache (DeepSeek-V4: with its state slots and prefix state snapshots; "
        "default: 1 GiB on CPU, 60%% of the free CUDA memory)",
        None,
    )
    enable_prefix_caching: bool = _doc("reuse the KV blocks of a shared prompt prefix", True)
    prefix_state_snapshots: int | None = _doc(
        "DeepSeek-V4 prefix caching: state snapshots kept at block boundaries, least recently "
        "used evicted (each one state slot's sliding-window ring and CSA compressor rows; the "
        "size is printed at start); default: 4 x max_num_seqs",
        None,
    )
    wait_for_shared_prefix: bool = _doc(
        "with prefix caching: a prompt whose next blocks another running request is computing "
        "(the same system prompt sent several times at once) waits for them instead of "
        "computing them again",
        True,
    )
    enable_chunked_prefill: bool = _doc("split prompts longer than the step's budget", True)
    num_speculative_tokens: int = _doc(
        "n-gram (prompt lookup) draft tokens per step for greedy requests (0 = off)", 0
    )
    use_cuda_graph: bool | None = _doc(
        "capture decode steps in CUDA graphs (default: on with CUDA)", None
    )
    async_scheduling: bool | None = _doc(
        "launch greedy decode steps one step ahead of the host (default: on with CUDA); "
        "outputs are the same, step() reports them one step later",
        None,
    )
    warmup: bool | None = _doc(
        "run throwaway requests of every step kind at construction, so kernel compiles land "
        "there and not in the first requests' steps (default: on with CUDA)",
        None,
    )
    seed: int = _doc("seed of the sampling generator for requests without their own seed", 0)
    window_pool_seqs: int | None = _doc(
        "running sequences each sliding-window KV pool is sized for (default: max_num_seqs, "
        "or fewer when kv_cache_memory cannot hold that many max_model_len sequences in every "
        "pool); the full-attention pool takes the rest of the memory",
        None,
    )
    sliding_window_kv: str = _doc(
        'KV blocks of sliding-window layers: "window" frees the blocks no future query can see '
        '(O(window) blocks per request); "full" keeps full-length pages and applies the window '
        "as a mask (more memory, for comparison)",
        "window",
    )
    tensor_parallel_size: int = _doc(
        "ranks the model's heads, MLP and vocabulary are split over (one process each, started "
        "and stopped by the engine; NCCL on CUDA, gloo on CPU)",
        1,
    )
    kv_rotation: bool = _doc(
        "rotate each head's q and k by a Hadamard matrix after RoPE (dense models, head_dim a "
        "power of two, one device): attention scores are unchanged and the cached keys' outlier "
        "channels are spread out, so a quantized kv_format (fp8 / int8 / fp4) stores them more "
        "accurately; off by default",
        False,
    )

    kv_exact_window: int = _doc(
        "with a quantized kv_format (fp8 / int8 / fp4): each sequence's last N positions are "
        "also kept unquantized (in the attention dtype) and attention reads them from there "
        "(most of a quantized cache's error is in the newest keys); 0 = off. Dense models on "
        "one device",
        0,
    )

    def __post_init__(self) -> None:
        if self.device is not None:
            if not isinstance(self.device, (str, torch.device)):
                raise TypeError(f"device must be a str, torch.device or None, got {self.device!r}")
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"device is not a valid device, got {self.device!r}") from exc
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        elif isinstance(self.dtype, torch.dtype) and self.dtype not in _AUTO_KV_FORMAT:
            raise ValueError(f"dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        _check_choice("backend", self.backend, BACKEND_NAMES)
        _check_choice("kv_format", self.kv_format, KV_FORMATS)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("num_blocks", self.num_blocks, 2, optional=True)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        _check_int("seed", self.seed, None)
        _check_int("window_pool_seqs", self.window_pool_seqs, 1, optional=True)
        _check_choice("sliding_window_kv", self.sliding_window_kv, SLIDING_WINDOW_KV)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_int("prefix_state_snapshots", self.prefix_state_snapshots, 1, optional=True)
        _check_bool("wait_for_shared_prefix", self.wait_for_shared_prefix)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_bool("use_cuda_graph", self.use_cuda_graph, optional=True)
        _check_bool("async_scheduling", self.async_scheduling, optional=True)
        _check_bool("warmup", self.warmup, optional=True)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_bool("kv_rotation", self.kv_rotation)
        _check_int("kv_exact_window", self.kv_exact_window, 0)
        if self.kv_exact_window and self.tensor_parallel_size > 1:
            raise ValueError(
                f"kv_exact_window={self.kv_exact_window} is not supported with "
                f"tensor_parallel_size={self.tensor_parallel_size} (one device only)"
            )
        if self.kv_rotation and self.tensor_parallel_size > 1:
            raise ValueError(
                f"kv_rotation=True is not supported with tensor_parallel_size="
                f"{self.tensor_parallel_size} (the worker ranks build their shards without it)"
            )
        if self.tensor_parallel_size > 1:
            for name in ("use_cuda_graph", "async_scheduling"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name}=True is not supported with tensor_parallel_size="
                        f"{self.tensor_parallel_size} (leave it None: off with tensor parallelism)"
                    )

    # ---------------------------------------------------------------- resolved values
    @property
    def torch_device(self) -> torch.device:
        """``device`` as a torch device (CUDA with an explicit index); RuntimeError when
        ``device`` asks for CUDA and none is available."""
        dev = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device={self.device!r} asks for CUDA, which is not available")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype: ``dtype``, or fp32 on CPU and bf16 on CUDA."""
        if self.dtype is None:
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return self.dtype if isinstance(self.dtype, torch.dtype) else DTYPES[self.dtype]

    @property
    def cuda_graphs_on(self) -> bool:
        return (
            self.torch_device.type == "cuda" if self.use_cuda_graph is None else self.use_cuda_graph
        )

    @property
    def warmup_on(self) -> bool:
        return self.torch_device.type == "cuda" if self.warmup is None else self.warmup

    @property
    def async_scheduling_on(self) -> bool:
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

    def model_max_len(self, max_position_embeddings: int) -> int:
        """`resolve_max_model_len` for building an engine: a ``max_model_len`` above the
        model's ``max_position_embeddings`` is a ValueError."""
        n = self.resolve_max_model_len(max_position_embeddings)
        if n > max_position_embeddings:
            raise ValueError(
                f"max_model_len={n} exceeds the model's "
                f"max_position_embeddings={max_position_embeddings}"
            )
        return n

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """``max_model_len``, or its default for a model with that position limit."""
        if self.max_model_len is not None:
            return self.max_model_len
        return min(DEFAULT_MAX_MODEL_LEN, max_position_embeddings)

    def resolve_kv_format(self, head_dim: int) -> str:
        """The stored KV format (``"auto"`` resolved to the model dtype); ``fp8`` / ``int8`` /
        ``fp4`` need ``head_dim`` to be a multiple of their scale group (32 / 32 / 16 values of
        a head)."""
        if self.kv_format == "auto":
            return _AUTO_KV_FORMAT[self.torch_dtype]
        group = QUANTIZED_KV_FORMATS.get(self.kv_format, (None, 1, None))[1]
        if head_dim % group:
            raise ValueError(
                f"kv_format={self.kv_format!r} needs head_dim % {group} == 0, got "
                f"head_dim={head_dim}"
            )
        return self.kv_format

    def resolve_kv_cache_memory(self) -> int:
        """Bytes for the KV cache: ``kv_cache_memory``, or its device default."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        dev = self.torch_device
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0] * DEFAULT_CUDA_KV_CACHE_SHARE)
        return DEFAULT_CPU_KV_CACHE_MEMORY


def _check_int(name: str, value: Any, minimum: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ---------------------------------------------------------------- command lines
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_CHOICES = {
    "backend": BACKEND_NAMES,
    "kv_format": KV_FORMATS,
    "sliding_window_kv": SLIDING_WINDOW_KV,
}
_ON_OFF = {"on": True, "off": False}
_ENGINE_FLAGS = "_engine_config_fields"  # namespace attribute: the flags that are fields


def add_engine_arguments(
    parser: argparse.ArgumentParser, names: tuple[str, ...], **defaults: Any
) -> None:
    """Add ``--<name>`` (underscores as dashes) for each `EngineConfig` field in ``names``,
    with the field's help and default (``defaults`` overrides a default). Optional bools
    take ``on``/``off``; other bools get ``--x`` / ``--no-x``."""
    for name in names:
        f = _FIELDS[name]
        overridden = name in defaults
        default = defaults.pop(name, f.default)
        flag = "--" + name.replace("_", "-")
        kind = f.type  # a string (postponed annotations)
        help_text = f.metadata["help"]
        if overridden:  # this command's own default, not the field's
            shown = {True: "on", False: "off"}.get(default, default) if "bool" in kind else default
            help_text = f"{help_text}; this command's default: {shown}"
        if kind == "bool | None":
            parser.add_argument(flag, choices=tuple(_ON_OFF), default=default, help=help_text)
        elif kind == "bool":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif kind.startswith("int"):
            parser.add_argument(flag, type=int, default=default, help=help_text)
        else:
            parser.add_argument(flag, choices=_CHOICES.get(name), default=default, help=help_text)
    if defaults:
        raise ValueError(f"defaults for fields not in names: {sorted(defaults)}")
    parser.set_defaults(**{_ENGINE_FLAGS: tuple(names)})


def config_from_args(args: argparse.Namespace, **settings: Any) -> EngineConfig:
    """An `EngineConfig` from the flags that `add_engine_arguments` added, plus ``settings``
    (which win: values a command fixes, e.g. ``max_num_seqs=1`` for one completion)."""
    values = {}
    for name in getattr(args, _ENGINE_FLAGS, ()):
        value = getattr(args, name)
        if _FIELDS[name].type == "bool | None" and isinstance(value, str):
            value = _ON_OFF[value]
        values[name] = value
    values.update(settings)
    return EngineConfig(**values)
