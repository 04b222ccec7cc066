"""One model served by several processes (tensor / expert parallel): rank 0 schedules, every rank steps.

Every rank holds a shard of the model and its own engine. The engine is deterministic given its inputs (requests
in order, their seeds, aborts), so rank 0 sends only those inputs: once per step, one broadcast of the control
messages gathered since the last step (`DistributedLLMEngine`); the other ranks replay them and take the same
step (`worker_loop`), so every collective inside the sharded model meets its partners. Sampling is replicated:
the logits are gathered on every rank and the same seeds give the same tokens. The adaptive verification budget
decides from a measured cost table and from measured step wall times: rank 0's table is sent to the others once
(`sync_budget`), and each step's message carries rank 0's clock at the step's start, which every rank's budget
reads instead of its own (`StepClock`), so that every rank drafts and verifies the same. (With each rank's own
clock the ranks' wall times differ, the regime decisions part, and one rank waits in a collective the other
never enters.)

Idle ranks wait in a broadcast. A server can stay idle for longer than any sensible collective timeout, so rank
0 sends an empty "idle" message every `HEARTBEAT_S` seconds without a step (`start_heartbeat`); a worker whose
parent (rank 0) has died exits at once instead of waiting for the timeout, and rank 0 exits when a worker dies.

    pg = launch(2, worker, (...))          # ranks 1.. run `worker`, which ends in `worker_loop(engine, pg)`
    engine = DistributedLLMEngine(..., pg=pg)   # rank 0, in this process
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparkspec.distributed import ParallelGroup
from sparkspec.engine.llm_engine import LLMEngine

TIMEOUT = timedelta(minutes=10)  # a collective that waits longer than this is an error, not a hang
HEARTBEAT_S = 30.0  # an idle rank 0 tells the others it is alive this often (well inside TIMEOUT)
_workers: list = []  # the processes `launch` started (joined by `finish`)
_finished = threading.Event()


class DistributedLLMEngine(LLMEngine):
    """Rank 0's engine: what it admits and aborts is replayed on the other ranks before each step."""

    def __init__(self, *args, pg: ParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.pg = pg
        self.async_scheduling = False  # every rank must step in turn, on the same committed state
        self._messages: list[tuple] = []
        self._lock = threading.Lock()  # one broadcast at a time: the step's or the heartbeat's
        self._last_send = time.monotonic()
        self._stopped = False
        sync_budget(self, pg)

    def add_request(self, prompt, params=None, request_id=None):
        seq = super().add_request(prompt, params, request_id)
        # the seed rank 0 drew travels with the request: every rank samples the same tokens
        self._messages.append(("add", seq.prompt_ids, dataclasses.replace(seq.params, seed=seq.seed),
                               seq.request_id))
        return seq

    def abort_request(self, request_id: str) -> bool:
        found = super().abort_request(request_id)
        if found:
            self._messages.append(("abort", request_id))
        return found

    def step(self):
        with self._lock:
            now = time.perf_counter()
            self._send(self._messages + [("clock", now)])
            self._messages = []
            set_step_clock(self, now)
            return super().step()

    def shutdown(self) -> None:
        """Ends the other ranks' loops (they return from `worker_loop`) and the heartbeat."""
        with self._lock:
            self._send([("stop",)])
            self._stopped = True

    def start_heartbeat(self, interval: float = HEARTBEAT_S) -> None:
        """A daemon thread that sends ("idle",) whenever no step was sent for `interval` seconds (a server
        waiting for requests); the other ranks take no step for it."""

        def beat():
            while not self._stopped:
                time.sleep(min(interval, 1.0))
                with self._lock:
                    if not self._stopped and time.monotonic() - self._last_send >= interval:
                        self._send([("idle",)])

        threading.Thread(target=beat, name="sparkspec-heartbeat", daemon=True).start()

    def _send(self, messages: list[tuple]) -> None:
        dist.broadcast_object_list([messages], src=0, group=self.pg.group)
        self._last_send = time.monotonic()


class StepClock:
    """The adaptive budget's clock on every rank: rank 0's `time.perf_counter()` at the start of the step in
    progress, set from the step's message."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sync_budget(engine: LLMEngine, pg: ParallelGroup) -> None:
    """Every rank takes rank 0's step-cost table (each rank measured its own, in lockstep) and reads step times
    from rank 0's clock (`StepClock`): the adaptive budget then chooses the same drafts everywhere. Called once by
    every rank after its engine is built."""
    budget = engine.spec.budget if engine.spec is not None else None
    box = [budget.cost if budget is not None else None]
    dist.broadcast_object_list(box, src=0, group=pg.group)
    if budget is not None:
        budget.cost = box[0]
        budget.clock = StepClock()


def set_step_clock(engine: LLMEngine, now: float) -> None:
    budget = engine.spec.budget if engine.spec is not None else None
    if budget is not None and isinstance(budget.clock, StepClock):
        budget.clock.now = now


def worker_loop(engine: LLMEngine, pg: ParallelGroup) -> None:
    """Ranks 1..: replay rank 0's requests and take the same steps until it stops."""
    engine.async_scheduling = False  # in turn, as rank 0 steps
    sync_budget(engine, pg)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=pg.group)
        messages = box[0]
        if messages == [("idle",)]:
            continue
        for message in messages:
            if message[0] == "stop":
                return
            if message[0] == "add":
                engine.add_request(*message[1:])
            elif message[0] == "clock":
                set_step_clock(engine, message[1])
            else:
                engine.abort_request(message[1])
        engine.step()


def rank_device(rank: int, device: str | None) -> torch.device:
    """cuda:rank (or the XPU) on accelerators, the CPU otherwise or when asked."""
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    kind = torch.device(device).type if device else "cuda"
    return torch.device(kind, rank)


def _entry(rank: int, world: int, init: str, backend: str, fn, args) -> None:
    parent = os.getppid()

    def orphaned():  # rank 0 died (killed, crashed): there is nobody left to follow
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                print(f"error: tensor-parallel rank {rank}: rank 0 exited; stopping", file=sys.stderr)
                os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    _join(backend, rank, world, init)
    try:
        fn(ParallelGroup(rank, world), *args)
    finally:
        dist.destroy_process_group()


def _join(backend: str, rank: int, world: int, init: str) -> None:
    """Join the group; NCCL ranks first select their own GPU (collectives and object broadcasts use the current
    device, which would otherwise be GPU 0 on every rank)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=init, timeout=TIMEOUT)


def launch(world: int, fn, args: tuple, device: torch.device) -> ParallelGroup:
    """Start ranks 1..world-1 as processes running fn(pg, *args) and join rank 0 from here -> rank 0's group.
    A rank that dies takes this process down with its exit code (a watchdog thread), so nothing waits forever."""
    backend = {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")  # ROCm builds name RCCL "nccl" too
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, init, backend, fn, args), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    _join(backend, 0, world, init)

    def watch():
        while not _finished.is_set():
            for r, p in enumerate(procs, 1):
                if p.exitcode not in (None, 0):
                    print(f"error: tensor-parallel rank {r} exited with code {p.exitcode}", file=sys.stderr)
                    os._exit(1)
            time.sleep(0.2)

    _finished.clear()
    _workers[:] = procs
    threading.Thread(target=watch, daemon=True).start()
    return ParallelGroup(0, world)


def finish(engine: DistributedLLMEngine | None) -> None:
    """Stop the other ranks, wait for them, and leave the group (rank 0, when done). Without an engine (the ranks
    ran the same program, as `bench latency` does) only the waiting and leaving."""
    if engine is not None:
        engine.shutdown()
    _finished.set()
    for p in _workers:
        p.join(timeout=60)
    _workers.clear()
    dist.destroy_process_group()
