"""Flatten, broadcast and copy an ``InputMetadata`` (the interface to CP groups and graphs).

* ``to_flatten_dict``: ONE level: a non-empty dict field ``klen = {"4": t}`` becomes
  ``"klen.4": t``; everything else (tensors, scalars, ``None``, empty dicts) keeps its name. The
  broadcast protocol relies on this depth limit (receivers refill by path).
* ``broadcast``: the source sends every non-tensor value by path, plus each tensor's path,
  shape and dtype, as one object (``broadcast_object_list``); then every tensor goes through a
  ``torch.distributed.broadcast`` collective. Receivers allocate the tensors and refill their
  object by path. Empty dicts are sent as values (an empty ``klen`` must stay a dict so that
  ``compute_attn_info`` knows to rebuild it). A tensor object reached by two paths is sent once.
* ``recursive_copy_``: copies tensors and one level of dicts of tensors in place (graph input
  buffers keep their addresses); scalars are not copied.
"""

from __future__ import annotations

from typing import Any

import torch

_BOOL_WIRE = torch.uint8  # gloo has no bool collectives: masks travel as uint8


def to_flatten_dict(meta) -> dict[str, Any]:
    """``{"positions": t, "klen.4": t, "ks": {}, "total_q": 7, ...}`` (one level)."""
    flat: dict[str, Any] = {}
    for name, value in vars(meta).items():
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                if not isinstance(key, str) or "." in key:
                    raise ValueError(f"{name} key {key!r} must be a string without '.'")
                flat[f"{name}.{key}"] = sub
        else:
            flat[name] = value
    return flat


def _fill(meta, flat: dict[str, Any]) -> None:
    for path, value in flat.items():
        name, dot, key = path.partition(".")
        if not dot:
            setattr(meta, name, value)
            continue
        target = getattr(meta, name, None)
        if not isinstance(target, dict):
            target = {}
            setattr(meta, name, target)
        target[key] = value


def from_flatten_dict(cls, flat: dict[str, Any]):
    """Inverse of :func:`to_flatten_dict`: split each key at its first ``.``."""
    meta = cls()
    for path in flat:  # reset dict fields that come back as sub-keys
        name, dot, _ = path.partition(".")
        if dot:
            setattr(meta, name, {})
    _fill(meta, flat)
    return meta


def broadcast(meta, src: int = 0, group: Any = None, device: torch.device | str | None = None):
    """Broadcast ``meta`` from rank ``src`` to every rank of ``group``; returns ``meta``.

    On ``src`` the object is read; on the other ranks it is overwritten field by field.
    Receivers allocate tensors on ``device`` (default: CPU for a gloo group, the current CUDA
    device otherwise).
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if device is None:
        backend = dist.get_backend(group)
        device = "cpu" if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if rank == src:
        values: dict[str, Any] = {}
        specs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        sent: list[torch.Tensor] = []
        seen: dict[int, int] = {}
        for path, value in to_flatten_dict(meta).items():
            if isinstance(value, torch.Tensor):
                if id(value) in seen:
                    specs.append((path, tuple(value.shape), value.dtype, seen[id(value)]))
                    continue
                seen[id(value)] = len(sent)
                specs.append((path, tuple(value.shape), value.dtype, -1))
                sent.append(value)
            else:
                values[path] = value
        header = [values, specs]
    else:
        header = [None, None]
    dist.broadcast_object_list(header, src=src, group=group)
    values, specs = header
    flat: dict[str, Any] = dict(values)
    tensors: list[torch.Tensor] = []
    for path, shape, dtype, dup in specs:
        if dup >= 0:
            flat[path] = tensors[dup]
            continue
        wire = _BOOL_WIRE if dtype == torch.bool else dtype
        if rank == src:
            t = sent[len(tensors)]
            buf = t.to(device=device, dtype=wire).contiguous()
        else:
            buf = torch.empty(shape, dtype=wire, device=device)
        dist.broadcast(buf, src=src, group=group)
        tensors.append(buf.to(dtype) if wire != dtype else buf)
        if rank != src:
            flat[path] = tensors[-1]
    if rank != src:
        for name in list(vars(meta)):
            if isinstance(getattr(meta, name), dict):
                setattr(meta, name, {})
        _fill(meta, flat)
    return meta


def _copy_tensor(dst: Any, src: torch.Tensor, label: str) -> None:
    if not isinstance(dst, torch.Tensor):
        raise ValueError(f"recursive_copy_: target has no tensor for {label} (got {dst!r})")
    if dst.dtype != src.dtype:
        raise TypeError(f"recursive_copy_: {label} dtype {dst.dtype} != {src.dtype}")
    if tuple(dst.shape) == tuple(src.shape):
        dst.copy_(src, non_blocking=True)
    elif dst.dim() == src.dim() and dst.shape[1:] == src.shape[1:] and dst.shape[0] >= src.shape[0]:
        dst[: src.shape[0]].copy_(src, non_blocking=True)  # capture-size buffer: write a prefix
    else:
        raise ValueError(
            f"recursive_copy_: {label} shape {tuple(src.shape)} does not fit {tuple(dst.shape)}"
        )


def recursive_copy_(meta, other):
    """Copy every tensor of ``other`` into the same field of ``meta`` in place.

    Tensors and one level of dicts of tensors are copied (``non_blocking``; into a prefix when
    the target has more rows, as capture-size buffers do). Scalars (``total_q``, ``num_seqs``,
    ``is_prompt``, ``total_k_*``) and ``None`` are NOT copied: the caller updates them. Raises
    ``ValueError`` / ``TypeError`` naming the field when a target tensor is missing or does not
    fit. Returns ``meta``.
    """
    for name, value in vars(other).items():
        if isinstance(value, torch.Tensor):
            _copy_tensor(getattr(meta, name, None), value, name)
        elif isinstance(value, dict):
            target = getattr(meta, name, None)
            for key, sub in value.items():
                if isinstance(sub, torch.Tensor):
                    dst = target.get(key) if isinstance(target, dict) else None
                    _copy_tensor(dst, sub, f"{name}[{key!r}]")
    return meta
