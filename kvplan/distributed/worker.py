"""The ranks other than 0: build the shard, then run the steps rank 0 broadcasts.

A worker owns its model shard, a KV cache of its heads and a metadata object of the engine's
backend whose manager is a `MirrorManager` (`kvplan.distributed.step_broadcast`). Its loop
receives a message, plans (``set_paged_step``) and runs the forward; the model's collectives
pair with rank 0's. It returns on ``SHUTDOWN``; a failed collective (rank 0 gone) raises.

`spawned_main` is the entry of a process that rank 0 started (`multiprocessing` spawn): it
reports ``("started", pid)`` and, on failure, ``("error", traceback)`` through its pipe, and
exits as soon as that pipe closes (rank 0's process ended), so no worker outlives its engine.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
import traceback
from typing import Any

import torch

from kvplan.distributed.context import TPContext
from kvplan.distributed.step_broadcast import Kind, MirrorManager, recv


@dataclasses.dataclass
class WorkerParts:
    model: Any
    metadata: Any
    mirror: MirrorManager
    device: torch.device


def build_worker(model: Any, config: Any, tp: TPContext) -> WorkerParts:
    """Rank ``tp.rank``'s shard and cache, sized exactly as rank 0 sizes its own (same
    ``config`` and model; the pool size is agreed with `agree_num_blocks`)."""
    from kvplan.backends import get_backend
    from kvplan.cache import KVCacheManager
    from kvplan.distributed.build import agree_num_blocks, build_rank_model, local_kv_config
    from kvplan.engine import builder
    from kvplan.models.loader import resolve_source

    source = resolve_source(model)
    cfg = source.config
    dev = config.torch_device
    fmt = config.resolve_kv_format(cfg.head_dim)
    max_model_len = config.model_max_len(cfg.max_position_embeddings)
    max_blocks_per_seq = -(-max_model_len // config.block_size)
    backend_cls = get_backend(config.backend)
    net = build_rank_model(
        source, backend_cls, max_positions=max_model_len, dtype=config.torch_dtype,
        device=dev, seed=config.seed, tp=tp,
    )  # fmt: skip
    kv_cfg = local_kv_config(cfg, tp.size)
    sizes = builder.paged_sizes(
        kv_cfg, config, fmt, max_model_len, max_blocks_per_seq,
        lambda n: agree_num_blocks(n, dev, tp),
    )  # fmt: skip
    manager = KVCacheManager.from_layer_windows(
        list(sizes.pools.num_blocks),
        config.block_size,
        cfg.windows,
        max_blocks_per_seq=max_blocks_per_seq,
        enable_prefix_caching=config.enable_prefix_caching,
        release_out_of_window=any(w is not None for w in cfg.windows),
    )
    mirror = MirrorManager(manager)
    family = builder._paged_family(kv_cfg, config, sizes, mirror)
    return WorkerParts(net, family.metadata, mirror, dev)


def serve(parts: WorkerParts, group: Any = None) -> None:
    """Run broadcast steps until ``SHUTDOWN``."""
    from kvplan.engine.families import PAGED, set_paged_step

    comm = parts.device
    while True:
        msg = recv(comm, group)
        if msg.kind == Kind.SHUTDOWN:
            return
        if msg.facts is not None:
            f = parts.mirror.facts = msg.facts
            set_paged_step(
                parts.metadata, f.request_ids, f.prompt_lens, f.num_cached_tokens,
                f.num_query_tokens, f.num_contexts,
            )  # fmt: skip
        if msg.input_ids is not None:
            parts.model(msg.input_ids, msg.positions, {PAGED: parts.metadata}, msg.logits_rows)


def rank_device(config: Any, local_rank: int) -> torch.device:
    """A rank's device: ``cuda:<local_rank>`` when the engine runs on CUDA, else the CPU."""
    if config.torch_device.type == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _watch_parent(conn: Any) -> None:
    """Exit this process as soon as the pipe to rank 0 closes (its process ended)."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(3)


def spawned_main(
    rank: int,
    size: int,
    init_method: str,
    backend: str,
    timeout_s: float,
    model: Any,
    config: Any,
    conn: Any,
    num_threads: int,
) -> None:
    """Entry of a worker process started by rank 0 (module docstring)."""
    import torch.distributed as dist

    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    try:
        torch.set_num_threads(num_threads)
        conn.send(("started", os.getpid()))
        if config.torch_device.type == "cuda":
            torch.cuda.set_device(config.torch_device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        serve(build_worker(model, config, TPContext(rank, size)))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)
