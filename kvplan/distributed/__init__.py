"""Tensor parallelism: one model split over ranks, one worker process per rank.

Modules (each one concern):

* `context` -- `TPContext` (a rank's index, the group size, its two collectives) and the
  divisibility rule `check_tensor_parallel`;
* `layers` -- `RowParallelLinear`, `VocabParallelEmbedding` (the model's split layers);
* `sharding` -- `shard_state_dict`: a full state dict -> one rank's tensors;
* `build` -- a rank's model shard and KV sizing, shared by rank 0 and the workers;
* `step_broadcast` -- what rank 0 sends each step, and the `MirrorManager` the workers plan with;
* `worker` -- the worker ranks' build and step loop, and the spawned process's entry;
* `group` -- `TensorParallelGroup`: rank 0 starts / joins the ranks, watches them, stops them;
* `runner` -- `TPModelRunner`: rank 0's runner, which broadcasts each step before running it;
* `engine` -- `build_tensor_parallel`, the entry `kvplan.engine.builder.build_engine` uses.

Only `context` and `layers` are imported by the model; the rest loads on first use.
"""

from __future__ import annotations

from kvplan._lazy import lazy_exports

__all__ = [
    "TPContext",
    "TensorParallelGroup",
    "check_tensor_parallel",
    "shard_state_dict",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "TPContext": "kvplan.distributed.context",
        "check_tensor_parallel": "kvplan.distributed.context",
        "shard_state_dict": "kvplan.distributed.sharding",
        "TensorParallelGroup": "kvplan.distributed.group",
    },
)
