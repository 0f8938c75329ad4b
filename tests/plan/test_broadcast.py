"""InputMetadata.broadcast over torch.distributed with the gloo backend (2 and 3 CPU processes)."""

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)


def _make():
    sys.path.insert(0, HERE)
    from plan_cases import random_config, random_decode_batch, random_prompt_batch

    from kvplan.plan import prepare_decode, prepare_prompt

    rng = np.random.default_rng(11)
    cfg = random_config(rng, dense_ratios=(2,), sparse_ratios=(2, 4), block_size=8)
    prompt = prepare_prompt(random_prompt_batch(rng, cfg), cfg)
    decode = prepare_decode(random_decode_batch(rng, cfg), cfg)
    decode.extra_alias = decode.positions  # one tensor object reached by two paths
    decode.some_scalar_list = [1, "x"]
    return cfg, prompt, decode


def _worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from kvplan.plan import InputMetadata

        _, prompt, decode = _make()
        for name, meta in (("prompt", prompt), ("decode", decode)):
            got = meta if rank == 0 else InputMetadata(klen={"junk": torch.zeros(1)})
            got.broadcast(src=0)
            torch.save(got.to_flatten_dict(), os.path.join(result_dir, f"{name}_{rank}.pt"))
            if rank > 0 and name == "decode":
                assert got.extra_alias is got.positions
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_gloo(tmp_path, world):
    mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path)),
        nprocs=world,
        # fork avoids re-importing torch per process; spawn once CUDA is initialized
        start_method="spawn" if torch.cuda.is_initialized() else "fork",
        join=True,
    )
    for name, rank in [(n, r) for n in ("prompt", "decode") for r in range(1, world)]:
        want = torch.load(tmp_path / f"{name}_0.pt", weights_only=False)
        got = torch.load(tmp_path / f"{name}_{rank}.pt", weights_only=False)
        assert sorted(got) == sorted(want), name
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
            else:
                assert got[key] == value, key
        assert got["kv_ca_index"] == {}  # empty dicts survive
        assert "klen.junk" not in got
