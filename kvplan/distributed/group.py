"""Rank 0's handle on a tensor-parallel group: start, watch, heartbeat, stop.

Two ways in:

* `TensorParallelGroup.spawn`: rank 0 is this process; ranks ``1..size-1`` are daemon
  processes started with ``multiprocessing`` spawn (`kvplan.distributed.worker.spawned_main`),
  joined through a ``file://`` rendezvous in a private temporary folder (no port to pick).
* `TensorParallelGroup.from_torchrun`: every rank is a process that ``torchrun`` started; the
  environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``) gives
  the rendezvous (``env://``). Ranks other than 0 serve in `kvplan.distributed.worker.serve`.

Failure handling (spawned workers):

* a monitor thread waits on every worker's process sentinel and pipe; a worker that exits
  while the engine runs marks the group failed with a message naming its rank, pid, exit
  code or signal and its traceback when it sent one, terminates the other workers, and (NCCL)
  aborts the process group so that a collective blocked on the dead rank returns;
* every message and forward runs inside `collective`: a failure before it raises at once; an
  exception inside it (gloo reports a closed peer within milliseconds) waits up to
  ``FAIL_GRACE_S`` for the monitor and raises ``RuntimeError`` naming the dead rank; any
  failed collective leaves the group failed (the ranks can no longer agree on the next step);
* a heartbeat thread broadcasts ``PING`` every ``HEARTBEAT_S`` while no step runs, so an idle
  engine keeps the workers' waits inside the collective timeout (``KVPLAN_TP_TIMEOUT``,
  seconds, default 300), which bounds a hung (not dead) rank;
* `close` (also at interpreter exit) sends ``SHUTDOWN`` to serving workers and joins them
  for up to ``JOIN_S`` seconds, then terminates and finally kills what is left (at once for
  workers that never reached their step loop, e.g. when the engine's build failed).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from kvplan.distributed.context import TPContext
from kvplan.distributed.step_broadcast import Kind, send

TIMEOUT_ENV = "KVPLAN_TP_TIMEOUT"
START_TIMEOUT_ENV = "KVPLAN_TP_START_TIMEOUT"
HEARTBEAT_S = 2.0
FAIL_GRACE_S = 5.0
JOIN_S = 10.0


def _seconds(env: str, default: float) -> float:
    value = os.environ.get(env, "")
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"{env} must be > 0, got {value!r}")
    return seconds


def collective_timeout() -> float:
    return _seconds(TIMEOUT_ENV, 300.0)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def torchrun_env() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets
    ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class TensorParallelGroup:
    """Rank 0's view of the group (module docstring). ``tp`` is its `TPContext`;
    ``device`` the device its messages travel on (the rank's CUDA device, or the CPU)."""

    def __init__(self, size: int, backend: str, device: torch.device) -> None:
        self.tp = TPContext(0, size)
        self.backend = backend
        self.device = device
        self.failure: str | None = None
        self.procs: dict[int, Any] = {}  # rank -> multiprocessing.Process (spawned workers)
        self._conns: dict[int, Any] = {}
        self._errors: dict[int, str] = {}
        self._lock = threading.RLock()
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._closing = False
        self._closed = False
        self._serving = False  # the workers run their step loop
        self._tmpdir: str | None = None
        self._stop_r = self._stop_w = None
        self._threads: list[threading.Thread] = []
        ref = weakref.ref(self)
        self._atexit = lambda: (g := ref()) is not None and g.close()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ start
    @classmethod
    def spawn(cls, model: Any, config_of_rank: Any, size: int) -> TensorParallelGroup:
        """Start ranks ``1..size-1`` and join them as rank 0. ``config_of_rank(r)`` is rank
        r's `EngineConfig`; ``model`` must pickle (a path, ``"random:<name>"``, a
        ``ModelConfig`` or None)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size > 1 needs this process without a torch.distributed "
                "process group (one is already initialized); under torchrun, let kvplan "
                "initialize it"
            )
        config0 = config_of_rank(0)
        cuda = config0.torch_device.type == "cuda"
        if cuda and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices, "
                f"found {torch.cuda.device_count()}"
            )
        group = cls(size, "nccl" if cuda else "gloo", config0.torch_device)
        try:
            group._start(model, config_of_rank, size)
        except BaseException:
            group.close()
            raise
        return group

    def _start(self, model: Any, config_of_rank: Any, size: int) -> None:
        import torch.distributed as dist

        from kvplan.distributed.worker import spawned_main

        timeout = collective_timeout()
        self._tmpdir = tempfile.mkdtemp(prefix="kvplan-tp-")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=spawned_main,
                args=(rank, size, init_method, self.backend, timeout, model,
                      config_of_rank(rank), child, torch.get_num_threads()),
                name=f"kvplan-tp-rank{rank}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            child.close()
            self.procs[rank], self._conns[rank] = proc, parent
        self._wait_started(_seconds(START_TIMEOUT_ENV, 120.0))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            self.backend, init_method=init_method, rank=0, world_size=size,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        self._start_thread(self._monitor, "kvplan-tp-monitor")

    def _wait_started(self, timeout: float) -> None:
        """Wait for every worker's ``started`` report; RuntimeError naming a rank that died,
        failed or did not report within ``timeout`` seconds."""
        pending = set(self.procs)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"tensor-parallel worker ranks {sorted(pending)} did not start within "
                    f"{timeout:.0f} s ({START_TIMEOUT_ENV})"
                )
            waits = {self._conns[r]: r for r in pending}
            waits.update({self.procs[r].sentinel: r for r in pending})
            for ready in mpc.wait(list(waits), timeout=left):
                rank = waits[ready]
                if ready is self._conns[rank] and ready.poll():
                    what, detail = ready.recv()
                    if what == "started":
                        pending.discard(rank)
                        continue
                    self._errors[rank] = detail
                self.procs[rank].join(FAIL_GRACE_S)
                text = self._describe(rank, "failed to start")
                if rank not in self._errors:  # it died before running kvplan's code
                    text += (
                        " (see its stderr; a script that starts a tensor-parallel engine needs "
                        "the `if __name__ == '__main__':` guard, as multiprocessing spawn "
                        "imports the main module in each worker)"
                    )
                raise RuntimeError(text)

    @classmethod
    def from_torchrun(cls, size: int, config_of_rank: Any) -> tuple[TensorParallelGroup, int]:
        """Join the group ``torchrun`` describes; returns (group, this rank). ``WORLD_SIZE``
        must equal ``size``."""
        import torch.distributed as dist

        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes"
            )
        config = config_of_rank(rank)
        cuda = config.torch_device.type == "cuda"
        group = cls(size, "nccl" if cuda else "gloo", config.torch_device)
        group.tp = TPContext(rank, size)
        if cuda:
            torch.cuda.set_device(config.torch_device)
        if not dist.is_initialized():
            dist.init_process_group(
                group.backend, init_method="env://", rank=rank, world_size=size,
                timeout=datetime.timedelta(seconds=collective_timeout()),
            )  # fmt: skip
        return group, rank

    def _start_thread(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def start_serving(self) -> None:
        """The workers entered their step loop: from now on idle time sends heartbeats and
        `close` sends ``SHUTDOWN``."""
        self._serving = True
        if self.tp.size > 1:
            self._start_thread(self._heartbeat, "kvplan-tp-heartbeat")

    # ------------------------------------------------------------------ failures
    def _describe(self, rank: int, what: str) -> str:
        proc = self.procs.get(rank)
        pid = "?" if proc is None else proc.pid
        code = None if proc is None else proc.exitcode
        text = f"tensor-parallel worker rank {rank} (pid {pid}) {what}: it {_exit_text(code)}"
        err = self._errors.get(rank)
        if err:
            text += "\n--- its traceback ---\n" + err.rstrip()
        return text

    def _fail(self, message: str) -> None:
        """Mark the group failed (first message wins); stop the other workers; abort NCCL."""
        with contextlib.suppress(Exception):
            if self.failure is None:
                self.failure = message
            self._failed.set()
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
            if self.backend == "nccl":
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()

    def _monitor(self) -> None:
        conns = {c: r for r, c in self._conns.items()}
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        while sentinels and not self._closing:
            ready = mpc.wait([*conns, *sentinels, self._stop_r])
            if self._stop_r in ready or self._closing:
                return
            for obj in ready:
                if obj in conns:
                    try:
                        what, detail = obj.recv()
                        if what == "error":
                            self._errors[conns[obj]] = detail
                    except (EOFError, OSError):
                        del conns[obj]
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    if self._closing:
                        return
                    proc = self.procs[rank]
                    proc.join(1.0)
                    conn = self._conns[rank]
                    with contextlib.suppress(EOFError, OSError):
                        while conn.poll(0.2):  # a traceback sent just before it exited
                            what, detail = conn.recv()
                            if what == "error":
                                self._errors[rank] = detail
                    self._fail(self._describe(rank, "died"))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._lock.acquire(timeout=HEARTBEAT_S):
                continue  # a step is running: that keeps the workers busy
            try:
                if self._closing or self._failed.is_set():
                    return
                with contextlib.suppress(RuntimeError), self.collective():
                    send(Kind.PING, self.device)
            finally:
                self._lock.release()

    def check(self) -> None:
        """RuntimeError when the group failed or was closed."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self._closed:
            raise RuntimeError("the tensor-parallel group was closed")

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Run a message and its forward: serialized with the heartbeat; any failure leaves
        the group failed and raises RuntimeError naming the dead rank when there is one."""
        with self._lock:
            self.check()
            try:
                yield
            except Exception as exc:
                if not self._failed.wait(FAIL_GRACE_S if self.procs else 0):
                    self._fail(f"a tensor-parallel collective failed on rank 0: {exc}")
                raise RuntimeError(self.failure) from exc
            except BaseException:  # interrupted mid-step: the ranks no longer agree
                self._fail("a tensor-parallel step was interrupted on rank 0")
                raise

    # ------------------------------------------------------------------ stop
    @property
    def worker_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def close(self) -> None:
        """Stop every worker and the process group (idempotent; also at interpreter exit)."""
        if self._closed:
            return
        self._closing = True
        self._stop.set()
        got = self._lock.acquire(timeout=JOIN_S)
        sent = False
        try:
            if got and self._serving and self.failure is None:
                with contextlib.suppress(Exception):
                    send(Kind.SHUTDOWN, self.device)
                    sent = True
        finally:
            self._closed = True
            if got:
                self._lock.release()
        # workers that got SHUTDOWN exit on their own; others (a failed start) are stopped now
        deadline = time.monotonic() + (JOIN_S if sent else 0.0)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for stop in (lambda p: p.terminate(), lambda p: p.kill()):
            alive = [p for p in self.procs.values() if p.is_alive()]
            for proc in alive:
                stop(proc)
            for proc in alive:
                proc.join(2.0)
        if self._stop_w is not None:
            with contextlib.suppress(Exception):
                self._stop_w.send(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        for conn in self._conns.values():
            conn.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        atexit.unregister(self._atexit)
