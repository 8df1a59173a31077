"""One case of the loop probe, in a child process of its own: the stand-in worker, fed
from a fake broadcast queue, runs the file's loop (the fix ends the process, so a case
cannot run in its caller's); or the executor's worker monitor, on a stand-in executor
whose workers are real processes. The child prints its events as JSON lines."""
from __future__ import annotations

import ast
import json
import logging
import os
import pickle
import sys
import threading
import time
import types

from .extract import (LOGGER_NAME, extract_worker_monitor, extract_worker_proc, fault_tolerance_statements,
                           init_settings, request_size, uses_rank0_only, worker_proc_class)
from .stand_ins import StandInExecutor, stuck_in_a_collective

# Long enough for a cold Python start on a loaded 2-core machine, short enough
# that "exits at once" means something: the blocking-teardown case must beat it.
CASE_TIMEOUT_SECONDS = 5


class QueueDrained(BaseException):
    """Raised by the fake queue when every call was handed out (not an Exception:
    the loop's own `except Exception` must not swallow it)."""


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


class FakeBroadcastQueue:
    def __init__(self, calls):
        self.calls = list(calls)

    def dequeue(self, timeout=None, cancel=None, indefinite=False):
        if not self.calls:
            raise QueueDrained
        return self.calls.pop(0)


class DeviceLost(Exception):
    """A worker's own exception type, as a vendor's runner raises it."""


# What a case may make the stand-in raise (case["error"]); RuntimeError by default.
ERRORS = {e.__name__: e for e in (RuntimeError, ValueError, KeyError, OSError, DeviceLost)}
CASE = {"error": None, "fail": ("execute_model",)}  # the running case's failure, set by drive()


def failure(default: type[Exception], message: str) -> Exception:
    return ERRORS.get(CASE["error"] or "", default)(message)


class StandInModelWorker:
    """What WorkerWrapperBase would be: the methods the executor calls by name. Those in
    the case's "fail" list raise (execute_model alone by default)."""

    def execute_model(self, scheduler_output):
        emit(ran="execute_model")
        raise failure(RuntimeError, "device out of memory during prefill")

    def sample_tokens(self, grammar_output):
        emit(ran="sample_tokens")
        if "sample_tokens" in CASE["fail"]:
            raise failure(RuntimeError, "grammar bitmask failed")
        return "token-7"

    def _other_call(self, name):
        emit(ran=name)
        if name in CASE["fail"]:
            raise failure(RuntimeError, f"{name} failed")
        return f"{name}-ok"

    def execute_dummy_batch(self, *args):
        return self._other_call("execute_dummy_batch")

    def check_health(self, *args):
        return self._other_call("check_health")

    def compile_or_warm_up_model(self, _):
        emit(ran="compile_or_warm_up_model")
        raise RuntimeError("warm-up failed: device out of memory")


def pickled_step(worker):
    emit(ran="pickled_step")
    return "pickled-ok"


def failing_pickled_step(worker):
    emit(ran="failing_pickled_step")
    raise failure(ValueError, "collective failed")


class FakeResponseQueue:
    """worker_response_mq, onto which releases before 0.10.2 put replies themselves. Its
    reader is on another node (n_remote_reader, as vLLM's MessageQueue counts them) for a
    worker on a node other than the engine's."""

    def __init__(self, n_remote_reader: int = 0) -> None:
        self.n_remote_reader = n_remote_reader

    def enqueue(self, response):
        status, value = response
        if status == "FAILURE":
            emit(reply="failure", message=str(value))
        else:
            emit(reply="success", value=value)


def rpc_request(call: dict, rank0_only: bool) -> tuple:
    """(method, args, kwargs, output_rank) as MultiprocExecutor.collective_rpc enqueues it;
    0.8.5 sends rank0_only (output rank 0, or every rank) in the last place."""
    output_rank = call["output_rank"]
    if rank0_only:
        assert output_rank in (0, None), "0.8.5 can only ask rank 0 or every rank"
        output_rank = output_rank == 0
    if call.get("pickled"):  # a callable, sent pickled; the worker passes itself as first argument
        return (pickle.dumps(globals()[call["method"]]), (), {}, output_rank)
    return (call["method"], (None,), {}, output_rank)


def run_child(path: str, case: dict) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    if case.get("monitor"):
        return run_monitor(path, case)
    try:
        prepared = prepare(path)
    except UnknownSwitch as e:
        emit(escaped=f"UnknownSwitch: {e}")
        sys.exit(3)
    drive(path, *prepared, case)


class UnknownSwitch(Exception):
    """The loop reads an attribute that the module sets from something these cases cannot know."""


def prepare(path: str):
    """The stand-in WorkerProc class, the file's class and what __init__ sets plainly;
    raises UnknownSwitch for a class whose loop reads a switch of unknown value."""
    with open(path, encoding="utf-8-sig") as f:
        tree = ast.parse(f.read(), filename=path)
    plain, unknown = init_settings(tree, worker_proc_class(tree))
    if unknown:
        raise UnknownSwitch(unknown)
    worker_proc_type, cls = extract_worker_proc(path)
    if not hasattr(worker_proc_type, "ResponseStatus"):  # a nested Enum, not extracted
        worker_proc_type.ResponseStatus = types.SimpleNamespace(SUCCESS="SUCCESS", FAILURE="FAILURE")
    return worker_proc_type, cls, plain


def drive(path: str, worker_proc_type, cls, plain, case: dict) -> None:
    """One case's calls through the loop of a stand-in worker, left as __init__ leaves it."""
    CASE["error"] = case.get("error")
    CASE["fail"] = tuple(case.get("fail") or ("execute_model",))
    proc = worker_proc_type.__new__(worker_proc_type)  # as tests make it: no __init__
    module = next((f.__globals__ for f in vars(worker_proc_type).values() if isinstance(f, types.FunctionType)), {})
    init_scope = {**module, "self": proc}  # the file's own imports: threading.Event() and the like
    for stmt in plain:
        exec(compile(ast.fix_missing_locations(ast.Module(body=[stmt], type_ignores=[])), path, "exec"), init_scope)
    # Fault tolerance as __init__ reads it: off (vLLM's default) unless the case says
    # otherwise; "absent": a release whose ParallelConfig has no such field.
    fault_tolerance = case.get("fault_tolerance")
    if fault_tolerance is None:
        fault_tolerance = False
    setting = {} if fault_tolerance == "absent" else {"enable_fault_tolerance": fault_tolerance}
    parallel_config = types.SimpleNamespace(**setting)
    init_scope = {"self": proc, "vllm_config": types.SimpleNamespace(parallel_config=parallel_config)}
    for stmt in fault_tolerance_statements(cls):
        exec(compile(ast.Module(body=[stmt], type_ignores=[]), path, "exec"), init_scope)
    proc.rank = case["rank"]
    proc.worker = StandInModelWorker()
    proc.use_async_scheduling = False
    proc.mm_receiver_cache = None  # 0.11.0's multimodal cache, off
    proc.worker_response_mq = FakeResponseQueue(1 if case.get("engine_on_another_node") else 0)
    rank0_only = uses_rank0_only(cls)
    size = request_size(cls)
    proc.rpc_broadcast_mq = FakeBroadcastQueue(rpc_request(c, rank0_only)[:size] for c in case["calls"])

    def handle_output(output):
        if isinstance(output, Exception):
            emit(reply="failure", message=str(output))
        else:
            emit(reply="success", value=output)

    proc.handle_output = handle_output
    try:
        proc.worker_busy_loop()
    except QueueDrained:
        emit(drained=True)
    except BaseException as e:
        # os._exit runs no handler: an exception here means the fix did not run its course
        # (a NameError for an unimported os would also end the process with status 1).
        emit(escaped=f"{type(e).__name__}: {e}")
        raise
    finally:
        if case.get("blocking_teardown"):
            # worker_main's finally: worker.shutdown() can wait forever on peers.
            threading.Event().wait()


def ends_as(how: str) -> None:
    """A worker's end once the monitor waits: an exit status ("1", "0") or a signal's name
    (SIGKILL as the OOM killer sends it, SIGTERM or SIGINT as a stop of the whole group)."""
    time.sleep(0.3)  # the monitor is waiting by then
    if how.startswith("SIG"):
        import signal

        ending = getattr(signal, how)
        if ending != signal.SIGKILL:  # its default action, not the probe's handler
            signal.signal(ending, signal.SIG_DFL)
        os.kill(os.getpid(), ending)
        time.sleep(10)
    os._exit(int(how))


def run_monitor(path: str, case: dict) -> None:
    import multiprocessing

    methods = extract_worker_monitor(path)
    context = multiprocessing.get_context("fork")
    peer = context.Process(target=stuck_in_a_collective, name="StuckPeer", daemon=True)
    dying = context.Process(target=ends_as, args=(case.get("worker_ends", "1"),), name="DyingWorker", daemon=True)
    peer.start()
    dying.start()
    executor = StandInExecutor(
        [types.SimpleNamespace(proc=peer, rank=0), types.SimpleNamespace(proc=dying, rank=1)],
        case.get("fault_tolerance"),
    )
    executor.bind(methods)
    try:
        if case["monitor"] == "inline":  # as a headless node runs it: it returns when a worker died
            executor.start_worker_monitor(inline=True)
        else:
            executor.start_worker_monitor()  # its thread waits for a worker to die
        called_back = executor.called_back.wait(CASE_TIMEOUT_SECONDS - 1)
        if executor.peers_alive_at_shutdown is not None:  # the dead worker's peers, as shutdown() found them
            emit(peers_alive_at_shutdown=executor.peers_alive_at_shutdown[:-1])
        emit(called_back=called_back, is_failed=executor.is_failed)
    finally:
        peer.kill()
