"""Replies through vLLM's real shared-memory MessageQueues, read and written by an
executor file's own code. Test-only; run with the Python of a vLLM install:

    python mq_replies.py EXECUTOR_FILE steps     # the executor's read of many steps
    python mq_replies.py EXECUTOR_FILE flush     # what a failing worker owes, before it exits
    python mq_replies.py EXECUTOR_FILE cancelled # a cancelled step with ranks on other nodes

EXECUTOR_FILE is a multiproc_executor.py of that install's release (the release's own, or
fixed by apply.py), loaded in place of the package's. Each mode prints one JSON line.

steps: two worker processes answer every step of a model step that every rank answers
(a KV connector's): rank 0 a small reply after 0.15 s, rank 1 a reply of 30 MiB, above
the response queue's chunk, so that it goes out as a slot and then a payload over zmq;
the writer pauses 50 ms between the two, as a descheduled thread would. The file's
collective_rpc reads STEPS (8) steps: {"steps": N read whole, "errors": [...]}.

flush: a WorkerProc of the file (made as vLLM's own tests make one, without __init__)
holds an earlier reply of 30 MiB whose payload its writer sends 0.2 s late, then fails a
call. For each case (output rank, sync or async output) the parent reads what arrives
and how the process ended: {"cases": [{"case": ..., "exit": code, "replies": [...]}]}.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
from collections import deque

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

LARGE = 30 << 20
STEPS = 8


def load_executor(path: str):
    spec = importlib.util.spec_from_file_location("vllm.v1.executor.multiproc_executor_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its ResponseStatus is pickled into replies by name
    spec.loader.exec_module(module)
    return module


class SlowPayloads:
    """A writer's socket that sends each payload late: its slot is already written."""

    def __init__(self, socket, seconds):
        self._socket, self._seconds = socket, seconds

    def send_multipart(self, *args, **kwargs):
        time.sleep(self._seconds)
        return self._socket.send_multipart(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._socket, name)


def answering_worker(rank, broadcast_handle, handles, module):
    broadcast = MessageQueue.create_from_handle(broadcast_handle, rank)
    response = MessageQueue(1, 1)
    handles.send(response.export_handle())
    broadcast.wait_until_ready()
    response.wait_until_ready()
    response.local_socket = SlowPayloads(response.local_socket, 0.05)
    success = module.WorkerProc.ResponseStatus.SUCCESS
    while True:
        method = broadcast.dequeue(indefinite=True)[0]
        if method == "stop":
            return
        if rank == 0:
            time.sleep(0.15)
            response.enqueue((success, b"rank 0"))
        else:
            response.enqueue((success, bytes(LARGE)))


class AllRanks:
    """A KV connector's aggregator: every rank answers the step."""

    def aggregate(self, outputs, output_rank=0):
        return list(outputs)


def executor_reading(module, broadcast, response_mqs):
    """The file's MultiprocExecutor with just what collective_rpc reads (fault tolerance off)."""
    parallel_config = types.SimpleNamespace(enable_fault_tolerance=False)
    executor = module.MultiprocExecutor.__new__(module.MultiprocExecutor)
    executor.__dict__.update(
        rpc_broadcast_mq=broadcast,
        response_mqs=response_mqs,
        is_failed=False,
        shutdown_event=threading.Event(),
        futures_queue=deque(),
        parallel_config=parallel_config,
        vllm_config=types.SimpleNamespace(parallel_config=parallel_config),
    )
    return executor


def steps(module) -> dict:
    context = multiprocessing.get_context("fork")
    broadcast = MessageQueue(2, 2)
    workers, response_mqs = [], []
    for rank in range(2):
        reader, writer = context.Pipe(duplex=False)
        worker = context.Process(target=answering_worker, args=(rank, broadcast.export_handle(), writer, module))
        worker.start()
        workers.append(worker)
        response_mqs.append(MessageQueue.create_from_handle(reader.recv(), 0))
    broadcast.wait_until_ready()
    for mq in response_mqs:
        mq.wait_until_ready()
    executor = executor_reading(module, broadcast, response_mqs)
    read, errors = 0, []
    try:
        for _ in range(STEPS):
            try:
                replies = executor.collective_rpc(
                    "execute_model", timeout=20, args=(None,), unique_reply_rank=0, kv_output_aggregator=AllRanks()
                )
            except Exception as e:  # the step is lost: go on, as the engine would not
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if replies == [b"rank 0", bytes(LARGE)]:
                read += 1
            else:
                errors.append(f"wrong replies: {[len(r) for r in replies]}")
    finally:
        broadcast.enqueue(("stop", (), {}, None))
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    return {"steps": read, "errors": errors}


class OneCall:
    """The worker's broadcast queue: one call, then nothing more, as a stuck engine."""

    def __init__(self, request):
        self.requests = [request]

    def dequeue(self, timeout=None, cancel=None, indefinite=False):
        if self.requests:
            return self.requests.pop()
        threading.Event().wait()


def failing_worker(module, handles, output_rank, async_output):
    response = MessageQueue(1, 1)
    handles.send(response.export_handle())
    response.wait_until_ready()
    response.local_socket = SlowPayloads(response.local_socket, 0.2)

    def fail(*args, **kwargs):
        raise RuntimeError("execute_model failed on purpose")

    proc = module.WorkerProc.__new__(module.WorkerProc)
    proc.rank = 1
    proc.worker = types.SimpleNamespace(execute_model=fail, sample_tokens=fail)
    proc.worker_response_mq = response
    proc.exit_on_unreported_failure = True  # as __init__ sets it without fault tolerance
    proc.use_async_scheduling = async_output
    if async_output:
        proc.async_output_queue = queue.Queue()
        threading.Thread(target=proc.async_output_busy_loop, daemon=True).start()
    proc.rpc_broadcast_mq = OneCall(("execute_model", (None,), {}, output_rank))
    proc.handle_output(bytes(LARGE))  # an earlier call's reply
    proc.worker_busy_loop()


def flush(module) -> dict:
    context = multiprocessing.get_context("fork")
    cases = []
    for output_rank in (0, None):
        for async_output in (False, True):
            reader, writer = context.Pipe(duplex=False)
            worker = context.Process(target=failing_worker, args=(module, writer, output_rank, async_output))
            worker.start()
            response = MessageQueue.create_from_handle(reader.recv(), 0)
            response.wait_until_ready()
            replies = []
            while True:
                try:
                    status, value = response.dequeue(timeout=2)
                except TimeoutError:
                    break
                except Exception as e:
                    replies.append(f"{type(e).__name__}: {e}")
                    break
                replies.append(f"{status.name} {len(value)} bytes" if isinstance(value, bytes) else f"{status.name} {value}")
            worker.join(1)  # the fix exits at once; the release serves on
            if worker.is_alive():
                worker.kill()
                worker.join()
            cases.append({"case": {"output_rank": output_rank, "async": async_output}, "exit": worker.exitcode, "replies": replies})
    return {"cases": cases}


def paired(local: bool):
    """(writer, reader) of one rank's response queue, both in this process: read through
    shared memory (a rank on this node), or over TCP on 127.0.0.1 (a rank on another)."""
    writer = MessageQueue(1, 1) if local else MessageQueue(1, 0, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0 if local else 1)
    ready = threading.Thread(target=writer.wait_until_ready)
    ready.start()
    reader.wait_until_ready()
    ready.join()
    return writer, reader


def cancelled(module) -> dict:
    """A step every rank answers (a KV connector's), rank 0 on this node and ranks 1-4 on
    others, all stuck (nothing written): shutdown() cancels the read 0.2 s in, as the
    worker monitor does. "none": no rank replied; "lost": rank 4's worker replied its
    failure before its connection dropped (the executor's lost_worker_mq); "polled" (a
    file whose future has poll()): read as the engine reads a step, rank 1 here replied its
    failure. Each: the seconds from the cancel to the step's end, and its error."""
    result = {}
    polls = hasattr(module.FutureWrapper, "poll")
    for case in ("none", "lost", "polled") if polls else ("none", "lost"):
        # polled (0.34.0 on, where the engine polls a step's future first): ranks 0 and 1
        # on this node, rank 1 replied its failure and exited, rank 0 waits in the collective.
        pairs = [paired(local=rank == 0 or case == "polled") for rank in range(2 if case == "polled" else 5)]
        writers, readers = [w for w, _ in pairs], [r for _, r in pairs]
        if case == "lost":
            writers[4].enqueue((module.WorkerProc.ResponseStatus.FAILURE, "rank 4: device out of memory"))
        if case == "polled":
            writers[1].enqueue((module.WorkerProc.ResponseStatus.FAILURE, "rank 1: device out of memory"))
        executor = executor_reading(module, types.SimpleNamespace(enqueue=lambda request: None), readers)
        if case == "lost":
            executor.lost_worker_mq = readers[4]
        cancel_at = []

        def shut_down():  # what shutdown() does to the engine's read
            time.sleep(0.2)
            cancel_at.append(time.monotonic())
            executor.shutting_down = True
            executor.shutdown_event.set()
            for mq in readers:
                mq.shutdown()

        threading.Thread(target=shut_down, daemon=True).start()
        try:
            future = executor.collective_rpc("execute_model", timeout=30, args=(None,), unique_reply_rank=0,
                                             kv_output_aggregator=AllRanks(), non_block=True)
            if case == "polled":  # as EngineCoreProc._wait_for_output: poll, wait briefly, then block
                pending, deadline = [], time.monotonic() + 1
                while not future.poll() and time.monotonic() < deadline:
                    future.wait_briefly(pending, deadline)
            future.result()
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        result[case] = {"seconds": round(time.monotonic() - cancel_at[0], 2), "error": error}
    return result


if __name__ == "__main__":
    executor_file, mode = sys.argv[1:3]
    module = load_executor(executor_file)
    print(json.dumps({"steps": steps, "flush": flush, "cancelled": cancelled}[mode](module)), flush=True)
    os._exit(0)  # the queues' zmq contexts would hold a normal exit
