"""Build a tensor-parallel engine: start (or join) the group, build rank 0's engine on it.

`build_tensor_parallel` is what `kvplan.engine.builder.build_engine` calls for
``tensor_parallel_size > 1``. It checks the model first (so a model that does not split fails
with a ValueError before any process starts), starts the workers (or joins ``torchrun``'s
ranks), then builds rank 0's engine with the group's hooks (`TPBuild`); a failure on the way
stops every worker. The returned `EngineParts` carry the group as ``tensor_parallel``;
``LLM.close()`` (or interpreter exit) stops it.

Under ``torchrun`` a rank other than 0 never returns: it serves steps until rank 0's engine
shuts down, then exits its process (``SystemExit(0)``).

Per rank: rank r runs on ``cuda:r`` (spawned) or ``cuda:LOCAL_RANK`` (torchrun) when the engine
runs on CUDA, else on the CPU; CUDA graphs and async scheduling are off.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from kvplan.distributed.build import (
    agree_num_blocks,
    build_rank_model,
    check_model,
    local_kv_config,
)
from kvplan.distributed.group import TensorParallelGroup, torchrun_env
from kvplan.distributed.runner import TPModelRunner
from kvplan.distributed.worker import build_worker, rank_device, serve


class TPBuild:
    """Rank 0's hooks into the single-device build (`kvplan.engine.builder`)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def build_model(self, source: Any, backend_cls: Any, **kwargs: Any) -> Any:
        return build_rank_model(source, backend_cls, tp=self.group.tp, **kwargs)

    def kv_config(self, cfg: Any) -> Any:
        """The model config with this rank's KV heads (for sizing and allocating the cache)."""
        return local_kv_config(cfg, self.group.tp.size)

    def num_blocks(self, num_blocks: int) -> int:
        return agree_num_blocks(num_blocks, self.group.device, self.group.tp)

    def runner(self, model: Any, families: Any, device: Any, manager: Any) -> TPModelRunner:
        return TPModelRunner(model, families, device, self.group, manager)


def rank_config(config: Any, local_rank: int) -> Any:
    """Rank ``local_rank``'s `EngineConfig`: its device; no CUDA graphs, no async steps."""
    return dataclasses.replace(
        config,
        device=rank_device(config, local_rank),
        use_cuda_graph=False,
        async_scheduling=False,
    )


def build_tensor_parallel(
    model: Any, config: Any, build: Callable[[Any, Any, TPBuild], Any], source: Any
) -> Any:
    """Rank 0's `EngineParts` of a ``config.tensor_parallel_size``-rank engine (module
    docstring); ``source`` is ``model`` resolved (`resolve_source`), ``build(source,
    rank 0's config, hooks)`` the single-device build."""
    size = config.tensor_parallel_size
    check_model(source, size)
    if torchrun_env():
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        group, rank = TensorParallelGroup.from_torchrun(size, lambda r: rank_config(config, local))
        if rank != 0:
            try:
                serve(build_worker(model, rank_config(config, local), group.tp))
            finally:
                group._serving = False  # rank 0 sent SHUTDOWN (or is gone)
                group.close()
            raise SystemExit(0)
    else:
        group = TensorParallelGroup.spawn(model, lambda r: rank_config(config, r), size)
    try:
        parts = build(source, rank_config(config, 0), TPBuild(group))
    except BaseException:
        group.close()
        raise
    parts.tensor_parallel = group
    return parts
