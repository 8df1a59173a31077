"""`apply.py --verify`: prove that the vLLM this node will run fails fast, on vLLM's own code.

apply.py calls run(path). It starts a harness child (children.py: harness), the
only process that imports vLLM, so apply.py itself never does. The harness
imports vllm.v1.executor.multiproc_executor by its real import path, forks two
worker processes that run the package's real WorkerProc RPC loop, fed through
the package's real shared-memory MessageQueue as the executor creates it, with
a stand-in model worker: execute_model raises, ping answers. No accelerator and
no model. It then checks, one line each:

  1. an all-rank call that fails (a utility call) gets a FAILURE reply from both
     ranks, which keep serving;
  2. a failing call with output rank 0 gets rank 0's FAILURE reply, rank 1 exits
     with status 1 and sends nothing, and rank 0 keeps serving; where the release
     samples in a call of its own (0.11.1 on), that failed step's sample_tokens gets
     execute_model's failure from rank 0, not an empty output (with async scheduling
     or pipeline parallelism the engine reads only that reply);
  3. the package's real MultiprocExecutor.start_worker_monitor, on a stand-in
     executor, marks it failed and calls shutdown and the failure callback;
  4. and it ends the dead worker's peer at once, before shutdown(), when that
     peer is stuck as in a collective with the dead rank (deaf to SIGTERM):
     shutdown() would wait for it before it releases the engine.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .spawn import child_command
from .outcome import OK, VERIFY_CANNOT_IMPORT, VERIFY_CANNOT_RUN, VERIFY_NOT_FAIL_FAST
from .loop_probe.extract import MONITOR_METHODS
from .loop_probe.stand_ins import StandInExecutor, stuck_in_a_collective

FAILS_FAST, NOT_FAIL_FAST, CANNOT_IMPORT, CANNOT_RUN = OK, VERIFY_NOT_FAIL_FAST, VERIFY_CANNOT_IMPORT, VERIFY_CANNOT_RUN
HARNESS_TIMEOUT_SECONDS = 180  # vLLM's import alone takes 8-15 s on a 2-core machine
STEP_TIMEOUT_SECONDS = 10


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a deadline, a dropped ssh session) while the harness runs:
    ended as Ctrl-C is, after the clean-up; apply.py exits with 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(path: str, root: str | None = None) -> tuple[int, str]:
    """Run the harness on the vllm that owns path; (exit code, the lines it printed)."""

    def interrupted(signum, frame):
        raise Interrupted(signum)

    # Armed before anything starts, so that every way out ends the harness's whole group.
    previous = {signum: signal.signal(signum, interrupted) for signum in (signal.SIGTERM, signal.SIGHUP)}
    harness = None
    rpc_dir = tempfile.mkdtemp(prefix="rank-exception-fatal-verify-")  # vLLM's zmq ipc sockets
    # Files, not pipes: a process the harness leaves in a session of its own can keep a
    # pipe open for good; the verdict is the harness's exit, not the end of its output.
    out_file = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    err_file = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    try:
        harness = subprocess.Popen(
            # The interpreter's own flags (-I, -E, -s...): the harness must see the sys.path
            # this Python sees. The root goes as an argument, which -E and -I keep.
            child_command("harness", path, root or "", flags=interpreter_flags()),
            env={**os.environ, "VLLM_RPC_BASE_PATH": rpc_dir},
            stdin=subprocess.DEVNULL,
            stdout=out_file,
            stderr=err_file,
            start_new_session=True,  # so that the clean-up can end the workers too
        )
        try:
            code = harness.wait(timeout=HARNESS_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        if harness is not None:
            kill_process_group(harness.pid)
            try:
                harness.wait(timeout=STEP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(rpc_dir, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return verdict(code, read_all(out_file), read_all(err_file))


def verdict(code: int | None, out: str, err: str) -> tuple[int, str]:
    """The harness's exit code (None: it did not finish) and its check lines, with what it
    left behind in /dev/shm or why it could not run."""
    if code is None:
        code = NOT_FAIL_FAST
        out += f"FAIL the check did not finish within {HARNESS_TIMEOUT_SECONDS}s\n"
    # Only the harness's own segments: a server on the node may make new ones meanwhile.
    segments = [line.split()[1] for line in out.splitlines() if line.startswith("shm ")]
    left = [name for name in segments if os.path.exists(os.path.join("/dev/shm", name))]
    if left:
        out += f"FAIL shared memory left in /dev/shm: {', '.join(left)}\n"
        code = code or NOT_FAIL_FAST
    # vLLM's own log lines share the harness's stdout; keep the check lines.
    out = "".join(line for line in out.splitlines(keepends=True) if line.startswith(("ok   ", "FAIL ")))
    if code not in (FAILS_FAST, NOT_FAIL_FAST, CANNOT_IMPORT):
        tail = " | ".join(err.strip().splitlines()[-3:])
        out += f"FAIL the check could not run: the harness ended with status {code}: {tail}\n"
        code = CANNOT_RUN
    return code, out.rstrip("\n")


def read_all(file) -> str:
    with file:
        file.seek(0)
        return file.read()


def interpreter_flags() -> list[str]:
    """The flags of this interpreter that change what it imports."""
    flags = sys.flags
    if flags.isolated:
        found = ["-I"]
    else:
        found = [flag for flag, on in (("-E", flags.ignore_environment), ("-s", flags.no_user_site)) if on]
        if getattr(flags, "safe_path", False):  # 3.11+
            found.append("-P")
    if flags.no_site:
        found.append("-S")
    return found


def kill_process_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # any worker the harness left behind
    except OSError:
        pass


# --- the harness: runs in its own process and imports vLLM ---------------------------


class StandInModelWorker:
    """Stands in for WorkerWrapperBase: the methods the executor calls by name."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, scheduler_output):
        raise RuntimeError(f"stand-in execute_model failed on rank {self.rank}")

    def sample_tokens(self, grammar_output):
        return f"tokens from rank {self.rank}"

    def ping(self):
        return f"pong from rank {self.rank}"

    def broken(self):
        raise RuntimeError(f"stand-in utility call failed on rank {self.rank}")


def serve(rank: int, conn) -> None:
    """A worker process: the package's WorkerProc loop on the package's MessageQueues."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.executor.multiproc_executor import WorkerProc

    broadcast_handle = conn.recv()
    proc = WorkerProc.__new__(WorkerProc)  # __init__ would load a model on a device
    proc.rank = rank
    proc.worker = StandInModelWorker(rank)
    proc.use_async_scheduling = False
    proc.exit_on_unreported_failure = True  # as __init__ sets it, fault tolerance off (where a release has it)
    proc.rpc_broadcast_mq = MessageQueue.create_from_handle(broadcast_handle, rank)
    proc.worker_response_mq = MessageQueue(1, 1)
    conn.send(proc.worker_response_mq.export_handle())
    # The same order as worker_main: it deadlocks if reordered.
    proc.rpc_broadcast_mq.wait_until_ready()
    proc.worker_response_mq.wait_until_ready()
    proc.worker_busy_loop()


def harness(path: str) -> int:
    """The checks, on the vLLM this Python imports, which must be path's: FAILS_FAST if
    every one holds, else NOT_FAIL_FAST (CANNOT_IMPORT if vLLM cannot be imported)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        from vllm.v1.executor import multiproc_executor
    except Exception as e:  # vLLM's import can fail in many ways; say which
        print(f"FAIL cannot import vllm.v1.executor.multiproc_executor: {type(e).__name__}: {e}")
        return CANNOT_IMPORT
    if os.path.realpath(multiproc_executor.__file__) != os.path.realpath(path):
        print(f"FAIL vllm.v1.executor.multiproc_executor is {multiproc_executor.__file__}, not {path}")
        return CANNOT_IMPORT
    print(f"ok   imported {multiproc_executor.__file__}")
    run = Harness(multiproc_executor, MessageQueue)
    # Every process it starts is ended in stop(), also when the start-up itself fails
    # (a MessageQueue with no room in /dev/shm): the stuck peer is deaf to the SIGTERM
    # that multiprocessing would send a daemon at exit.
    try:
        if not run.start():
            print("FAIL a worker did not start")
            return NOT_FAIL_FAST
        run.check_an_all_rank_call()
        started = time.monotonic()
        run.check_a_failing_step()
        run.check_the_monitor(started)
    finally:
        run.stop()
    return NOT_FAIL_FAST if run.failures else FAILS_FAST


class Harness:
    """Two worker processes running the package's WorkerProc loop on the package's
    MessageQueues, a peer stuck as in a collective, and the package's worker monitor
    on a stand-in executor that watches rank 1 and that peer (rank 0 stays outside, so
    that it can show that it keeps serving). Each check prints one line."""

    def __init__(self, multiproc_executor, message_queue) -> None:
        import multiprocessing
        from multiprocessing import resource_tracker

        self.module, self.message_queue = multiproc_executor, message_queue
        status = multiproc_executor.WorkerProc.ResponseStatus
        self.success, self.failure = status.SUCCESS, status.FAILURE
        # One tracker for every process: it unlinks what a dead worker leaves in /dev/shm.
        resource_tracker.ensure_running()
        self.context = multiprocessing.get_context("fork")  # the workers reuse this import
        self.peer = self.context.Process(target=stuck_in_a_collective, name="VerifyStuckPeer", daemon=True)
        self.procs, self.responses, self.failures = [], [], []
        self.broadcast = self.executor = None

    def start(self) -> bool:
        """The workers and their queues, and the monitor; False if a worker did not start."""
        import types

        MessageQueue = self.message_queue
        self.peer.start()
        pipes = []
        for rank in range(2):
            parent_end, child_end = self.context.Pipe()
            proc = self.context.Process(target=serve, args=(rank, child_end), name=f"VerifyWorker_{rank}", daemon=True)
            proc.start()
            pipes.append(parent_end)
            self.procs.append(proc)
        self.broadcast = MessageQueue(2, 2)
        print(f"shm {self.broadcast.handle.buffer_handle[-1]}", flush=True)
        for pipe in pipes:
            pipe.send(self.broadcast.export_handle())
        for pipe in pipes:
            if not pipe.poll(STEP_TIMEOUT_SECONDS):
                return False
            self.responses.append(MessageQueue.create_from_handle(pipe.recv(), 0))
            print(f"shm {self.responses[-1].handle.buffer_handle[-1]}", flush=True)
        self.broadcast.wait_until_ready()
        for response in self.responses:
            response.wait_until_ready()
        handles = [types.SimpleNamespace(proc=p, rank=rank) for rank, p in enumerate((self.peer, self.procs[1]))]
        self.executor = StandInExecutor(handles)
        executor_class = self.module.MultiprocExecutor
        self.executor.bind({name: getattr(executor_class, name) for name in MONITOR_METHODS if hasattr(executor_class, name)})
        self.executor.start_worker_monitor()
        return True

    def check(self, ok: bool, line: str) -> bool:
        print(("ok   " if ok else "FAIL ") + line, flush=True)
        if not ok:
            self.failures.append(line)
        return ok

    def reply(self, rank: int, timeout: float = STEP_TIMEOUT_SECONDS):
        try:
            return self.responses[rank].dequeue(timeout=timeout)
        except TimeoutError:
            return None

    def check_an_all_rank_call(self) -> None:
        self.broadcast.enqueue(("broken", (), {}, None))
        failed = [self.reply(0), self.reply(1)]
        self.broadcast.enqueue(("ping", (), {}, None))
        pinged = [self.reply(0), self.reply(1)]
        self.check(
            [r and r[0] for r in failed] == [self.failure, self.failure]
            and [r and r[0] for r in pinged] == [self.success, self.success]
            and all(p.is_alive() for p in self.procs),
            "an all-rank call that fails: both ranks reply FAILURE and keep serving",
        )

    def check_a_failing_step(self) -> None:
        import multiprocessing.connection

        self.broadcast.enqueue(("execute_model", (None,), {}, 0))
        rank0 = self.reply(0)
        dying = self.procs[1]
        exited = bool(multiprocessing.connection.wait([dying.sentinel], STEP_TIMEOUT_SECONDS))
        # vLLM's monitor polls the dead worker's status too (proc.exitcode); two threads
        # reaping one child race, and the loser sees none. So let the monitor finish first,
        # then join: a blocking wait that gets the status once the process is reapable.
        self.executor.called_back.wait(STEP_TIMEOUT_SECONDS if exited else 0.5)
        if exited:
            dying.join(STEP_TIMEOUT_SECONDS)
        self.check(rank0 is not None and rank0[0] == self.failure, "output rank 0 replies FAILURE to the failing call")
        self.check(
            exited and dying.exitcode == 1,
            f"rank 1 exits with status 1 (exit status: {dying.exitcode})"
            if exited
            else f"rank 1 exits with status 1 (still running after {STEP_TIMEOUT_SECONDS}s)",
        )
        self.check(self.reply(1, timeout=0.5) is None, "rank 1 sends nothing")
        self.broadcast.enqueue(("ping", (), {}, 0))
        pong = self.reply(0)
        self.check(pong is not None and pong[0] == self.success and self.procs[0].is_alive(), "rank 0 keeps serving")
        if hasattr(self.module.MultiprocExecutor, "sample_tokens"):
            self.broadcast.enqueue(("sample_tokens", (None,), {}, 0))
            sampled = self.reply(0)
            self.check(
                sampled is not None and sampled[0] == self.failure
                and "stand-in execute_model failed on rank 0" in str(sampled[1]),
                "a failed step's sample_tokens: rank 0 replies execute_model's failure, not an empty output",
            )

    def check_the_monitor(self, started: float) -> None:
        executor = self.executor
        if self.check(
            executor.called_back.is_set() and executor.is_failed and executor.shutdown_called,
            "the worker monitor marks the executor failed, calls shutdown and the failure callback",
        ):
            print(f"ok   {executor.failed_at - started:.2f}s from the failing call to the monitor firing")
        peer_ended = executor.peers_alive_at_shutdown == [False, False]
        self.check(
            peer_ended,
            "the monitor ends the dead worker's stuck peer before shutdown(), which would wait for it"
            + ("" if peer_ended or executor.peers_alive_at_shutdown is None else " (still alive then)"),
        )

    def stop(self) -> None:
        for proc in (*self.procs, self.peer):
            if proc.pid is not None and proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(STEP_TIMEOUT_SECONDS)
        # The workers wrote these; a killed writer cannot unlink its own.
        for queue in self.responses:
            unlink_shared_memory(queue.handle.buffer_handle[-1])


def unlink_shared_memory(name: str) -> None:
    from multiprocessing import shared_memory

    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()
