"""Test-only vLLM plugin: make one rank's execute_model fail once, on request.

vLLM loads every `vllm.general_plugins` entry point in each of its processes; this
one is found through the .dist-info beside it when this folder is on PYTHONPATH,
so the vLLM install itself is never touched. It does nothing unless
RANK_FAULT_TRIGGER names a path. When a file TRIGGER.RANK appears holding a
point, the worker of that (global) rank fails its next execute_model that schedules
tokens (vLLM also sends empty steps), and only that one:

  start    raises before the model runs: the other ranks go on into the forward
  forward  raises inside the forward, before the last decoder layer: after the
           first layer's all-reduce, so the other ranks are mid-collective
  sample   raises in the sample_tokens call that follows, after the logits:
           this rank skips sampling and the ranks' batches part
  hang     blocks for good, deaf to SIGTERM, as a rank does on an accelerator
           whose collective waits for a peer that died: NCCL and HCCL neither
           fail nor return to Python. (Here the ranks all-reduce over gloo's TCP,
           which fails at once when a peer's socket closes.)

It also reports how each child of the process exits ("rank_fault: pid N exited
with status S"), read with waitid(WNOWAIT), which leaves the child for its parent
to reap: vLLM's own monitor line may say "exit code: None", as it polls a worker
that has closed its pipes but is not yet reapable.

The rank that fires renames the file to TRIGGER.RANK.fired and writes into it
the wall-clock time of the fault, which the timeline reads as its zero.
"""
from __future__ import annotations

import functools
import os
import signal
import time

POINTS = ("start", "forward", "sample", "hang")


class InjectedFault(RuntimeError):
    pass


def trigger(rank: int) -> str:
    return f"{os.environ['RANK_FAULT_TRIGGER']}.{rank}"


def claim(rank: int) -> str | None:
    """The fault point asked of this rank, if any; claims it, so it fires once."""
    try:
        with open(trigger(rank)) as f:
            point = f.read().strip()
    except OSError:
        return None
    if point not in POINTS:
        return None
    try:
        os.rename(trigger(rank), trigger(rank) + ".fired")  # atomic: only one step wins
    except OSError:
        return None
    return point


def fire(rank: int, point: str) -> None:
    with open(trigger(rank) + ".fired", "w") as f:
        f.write(f"{time.time():.6f}\n")
    if point == "hang":
        print(f"rank_fault: rank {rank} hangs", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while True:
            time.sleep(3600)
    raise InjectedFault(f"rank_fault: injected failure on rank {rank} at {point}")


def register() -> None:
    if not os.environ.get("RANK_FAULT_TRIGGER"):
        return
    watch_children()
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if getattr(WorkerWrapperBase.execute_model, "rank_fault", False):
        return
    execute_model = WorkerWrapperBase.execute_model

    @functools.wraps(execute_model)
    def faulty_execute_model(self, scheduler_output, *args, **kwargs):
        rank = global_rank(self)
        point = claim(rank) if scheduler_output.total_num_scheduled_tokens > 0 else None
        if point in ("start", "hang"):
            fire(rank, point)
        if point == "forward":
            arm_forward(self.worker.model_runner, rank)
        output = execute_model(self, scheduler_output, *args, **kwargs)
        if point == "sample":
            arm_sample(self.worker, rank)
        return output

    faulty_execute_model.rank_fault = True
    WorkerWrapperBase.execute_model = faulty_execute_model


def global_rank(wrapper) -> int:
    """The worker's rank across all nodes, which TRIGGER.RANK names. Its rpc_rank is its
    index on its own node: on two nodes of one rank each, both ranks have rpc_rank 0.
    On one node the two are equal (vLLM before WorkerWrapperBase.global_rank: rpc_rank)."""
    return getattr(wrapper, "global_rank", wrapper.rpc_rank)


def arm_forward(model_runner, rank: int) -> None:
    layer = model_runner.model.model.layers[-1]

    def hook(module, args):
        handle.remove()
        fire(rank, "forward")

    handle = layer.register_forward_pre_hook(hook)


def arm_sample(owner, rank: int) -> None:
    """Fail owner's next sample_tokens call, once: an attribute on the instance takes the call
    that a look-up by attribute makes (WorkerWrapperBase's on its worker; ray_legacy's
    execute_model_ray's on its model runner)."""

    def sample_tokens(*args, **kwargs):
        del owner.sample_tokens
        fire(rank, "sample")

    owner.sample_tokens = sample_tokens


def watch_children() -> None:
    """Log each child's exit status as it ends (EngineCore's children are the workers)."""
    import threading

    # Once a process: vLLM may load plugins twice, and a forked child inherits the
    # mark but not the thread.
    if getattr(watch_children, "pid", None) == os.getpid():
        return
    watch_children.pid = os.getpid()
    seen: set[int] = set()

    def wait_for(pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        how = "exited with status" if info.si_code == os.CLD_EXITED else "was killed by signal"
        print(f"rank_fault: pid {pid} {how} {info.si_status}", flush=True)

    def scan() -> None:
        while True:
            for pid in children():
                if pid not in seen:
                    seen.add(pid)
                    threading.Thread(target=wait_for, args=(pid,), daemon=True).start()
            time.sleep(0.2)

    threading.Thread(target=scan, daemon=True, name="rank_fault-children").start()


def children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.extend(int(pid) for pid in f.read().split())
        except OSError:
            pass
    return pids
