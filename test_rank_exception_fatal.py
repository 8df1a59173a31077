"""Drive vLLM's real worker RPC loop and check that a failing non-output rank exits.

The loop is taken from vllm/v1/executor/multiproc_executor.py with ast (every
release shape from 0.8.5 on: the loop inline in WorkerProc.worker_busy_loop or
calling WorkerProc._execute_worker_rpc; replying through handle_output or
straight onto worker_response_mq; reading the call's output rank, or 0.8.5's
rank0_only flag), bound to a stand-in worker process and fed from a fake
broadcast queue, one child Python process per case: the fix ends the process,
so a case cannot run in the test's own.

The executor's worker monitor (MultiprocExecutor.start_worker_monitor) is taken
the same way and run on a stand-in executor whose workers are real processes:
when one dies, the monitor must end its peers before it calls shutdown(), which
would otherwise wait seconds for a peer stuck in a collective before it
releases the engine.

Where the release has parallel_config.enable_fault_tolerance (0.27.0 on), the
fix must keep the release's behaviour with it on; both settings are run. Whether
the release has it: $RANK_EXCEPTION_FATAL_FAULT_TOLERANCE (yes/no, as
releases/releases.tsv says) when set, else the release's own vllm/config beside
the target, else whether the target file mentions it.

Target: $GAUDI_FIXES_ROOT/vllm/... when GAUDI_FIXES_ROOT is set, else the
installed vLLM, located without importing it (importing vLLM needs torch and a
device). Standard library only; runs under pytest or `python3 -m unittest`.
"""
from __future__ import annotations

import ast
import collections
import contextlib
import importlib.util
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
import unittest

RELATIVE_PATH = os.path.join("vllm", "v1", "executor", "multiproc_executor.py")
LOGGER_NAME = "vllm.v1.executor.multiproc_executor"
# Long enough for a cold Python start on a loaded 2-core machine, short enough
# that "exits at once" means something: the blocking-teardown case must beat it.
CASE_TIMEOUT_SECONDS = 5


def find_target() -> str | None:
    root = os.environ.get("GAUDI_FIXES_ROOT")
    if root:
        return os.path.join(root, RELATIVE_PATH)
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], *RELATIVE_PATH.split(os.sep)[1:])


# --- extraction --------------------------------------------------------------


def worker_proc_class(tree: ast.Module) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "WorkerProc":
            return node
    raise AssertionError("no class WorkerProc in the file")


def reads_fault_tolerance(node: ast.AST) -> bool:
    # parallel_config.enable_fault_tolerance, or getattr(..., "enable_fault_tolerance", ...)
    return (isinstance(node, ast.Attribute) and node.attr == "enable_fault_tolerance") or (
        isinstance(node, ast.Constant) and node.value == "enable_fault_tolerance"
    )


def fault_tolerance_statements(cls: ast.ClassDef) -> list[ast.stmt]:
    """The statements of WorkerProc.__init__ that read enable_fault_tolerance."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return [stmt for stmt in node.body if any(reads_fault_tolerance(n) for n in ast.walk(stmt))]
    return []


def release_has_fault_tolerance(target: str) -> bool:
    """Whether the release declares parallel_config.enable_fault_tolerance (0.27.0 and later)."""
    told = os.environ.get("RANK_EXCEPTION_FATAL_FAULT_TOLERANCE")
    if told in ("yes", "no"):
        return told == "yes"
    vllm_dir = os.path.dirname(os.path.dirname(os.path.dirname(target)))
    for config in (os.path.join(vllm_dir, "config", "parallel.py"), os.path.join(vllm_dir, "config.py")):
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                return any(line.startswith("    enable_fault_tolerance") for line in f)
    with open(target, encoding="utf-8") as f:
        return "enable_fault_tolerance" in f.read()


def has_sample_tokens(target: str) -> bool:
    """Whether the executor sends sample_tokens after execute_model (0.11.1 and later)."""
    with open(target, encoding="utf-8") as f:
        return '"sample_tokens"' in f.read()


def uses_rank0_only(cls: ast.ClassDef) -> bool:
    """0.8.5 sends a rank0_only flag where later releases send the output rank."""
    return any(isinstance(n, ast.Name) and n.id == "rank0_only" for n in ast.walk(cls))


def request_size(cls: ast.ClassDef) -> int:
    """How many items the loop unpacks from the broadcast queue: 3 before 0.8.5
    (method, args, kwargs: every rank answers), 4 from then on (and the output rank)."""
    for node in ast.walk(cls):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "dequeue"):
            return len(node.targets[0].elts)
    return 4


def strip_annotations(function: ast.FunctionDef) -> None:
    # Annotations name vLLM types that the stand-in module does not have.
    for node in ast.walk(function):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None


def stdlib_imports(tree: ast.Module) -> list[ast.stmt]:
    """The module's own imports of standard-library names (os, partial, traceback...)."""
    kept = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a for a in node.names if a.name.split(".")[0] in sys.stdlib_module_names]
            if names:
                kept.append(ast.Import(names=names))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in sys.stdlib_module_names:
                kept.append(node)
    return kept


class FakeWatchdog:
    """vLLM 0.33.0's worker watchdog, which the loop feeds and pauses."""

    @staticmethod
    @contextlib.contextmanager
    def disable():
        yield

    @staticmethod
    def feed():
        pass


def extract_worker_proc(path: str) -> tuple[type, ast.ClassDef]:
    """WorkerProc from the file, less __init__, decorators and vLLM-typed members."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    cls = worker_proc_class(tree)
    body: list[ast.stmt] = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name != "__init__":
            node.decorator_list = [
                d for d in node.decorator_list if isinstance(d, ast.Name) and d.id == "staticmethod"
            ]
            strip_annotations(node)
            body.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            body.append(node)  # class-level defaults
        elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Constant) and node.simple:
            body.append(ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node))
    stand_in = ast.ClassDef(
        name="WorkerProc", bases=[], keywords=[], body=body, decorator_list=[]
    )
    if sys.version_info >= (3, 12):
        stand_in.type_params = []
    module = ast.Module(body=[*stdlib_imports(tree), stand_in], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace = {
        "__name__": "multiproc_executor_under_test",
        "logger": logging.getLogger(LOGGER_NAME),
        "cloudpickle": pickle,  # same loads() contract for what the child pickles
        "get_watch_dog": FakeWatchdog,
    }
    exec(compile(module, path, "exec"), namespace)
    return namespace["WorkerProc"], cls


def extract_worker_monitor(path: str):
    """MultiprocExecutor.start_worker_monitor from the file, as a plain function."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MultiprocExecutor"]
    [function] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "start_worker_monitor"]
    strip_annotations(function)
    module = ast.Module(body=[*stdlib_imports(tree), function], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace = {"__name__": "multiproc_executor_under_test", "logger": logging.getLogger(LOGGER_NAME)}
    exec(compile(module, path, "exec"), namespace)
    return namespace["start_worker_monitor"]


def extract_collective_rpc(path: str):
    """MultiprocExecutor.collective_rpc and the FutureWrapper it returns, from the file
    (0.11.1 on, where replies come through the executor's response_mqs)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MultiprocExecutor"]
    [function] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "collective_rpc"]
    strip_annotations(function)
    definitions = [function]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "FutureWrapper":
            for method in node.body:
                if isinstance(method, ast.FunctionDef):
                    strip_annotations(method)
            definitions.insert(0, node)
    module = ast.Module(body=[*stdlib_imports(tree), *definitions], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace = {
        "__name__": "multiproc_executor_under_test",
        "logger": logging.getLogger(LOGGER_NAME),
        "cloudpickle": pickle,
        "WorkerProc": types.SimpleNamespace(ResponseStatus=ResponseStatus),
        "KVConnectorOutput": type("KVConnectorOutput", (), {}),
    }
    exec(compile(module, path, "exec"), namespace)
    return namespace["collective_rpc"]


class ResponseStatus:
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    FAILURE_WITH_KV_OUTPUT = "FAILURE_WITH_KV_OUTPUT"


# --- the child process: one case ---------------------------------------------


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


class StandInModelWorker:
    """What WorkerWrapperBase would be: the methods the executor calls by name."""

    def execute_model(self, scheduler_output):
        emit(ran="execute_model")
        raise RuntimeError("device out of memory during prefill")

    def sample_tokens(self, grammar_output):
        emit(ran="sample_tokens")
        return "token-7"

    def compile_or_warm_up_model(self, _):
        emit(ran="compile_or_warm_up_model")
        raise RuntimeError("warm-up failed: device out of memory")


def pickled_step(worker):
    emit(ran="pickled_step")
    return "pickled-ok"


def failing_pickled_step(worker):
    emit(ran="failing_pickled_step")
    raise ValueError("collective failed")


class FakeResponseQueue:
    """worker_response_mq, onto which releases before 0.10.2 put replies themselves."""

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

    worker_proc_type, cls = extract_worker_proc(path)
    if not hasattr(worker_proc_type, "ResponseStatus"):  # a nested Enum, not extracted
        worker_proc_type.ResponseStatus = types.SimpleNamespace(SUCCESS="SUCCESS", FAILURE="FAILURE")
    proc = worker_proc_type.__new__(worker_proc_type)  # as tests make it: no __init__
    # The class as __init__ leaves it: fault tolerance off (vLLM's default) unless the
    # case says otherwise; "absent": a release whose ParallelConfig has no such field.
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
    proc.worker_response_mq = FakeResponseQueue()
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


def exits_with_status_1() -> None:
    time.sleep(0.3)  # the monitor is waiting by then
    os._exit(1)


def stuck_in_a_collective() -> None:
    # A rank waiting in a collective for a peer that died never returns to Python:
    # SIGTERM does not reach it (NCCL and HCCL wait so).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    while True:
        time.sleep(3600)


class StandInExecutor:
    """What start_worker_monitor reads and calls on a MultiprocExecutor."""

    def __init__(self, workers, fault_tolerance):
        self.workers = workers
        self.is_failed = False
        self.shutting_down = False
        setting = {} if fault_tolerance in (None, "absent") else {"enable_fault_tolerance": fault_tolerance}
        self.parallel_config = types.SimpleNamespace(**setting)
        self.called_back = threading.Event()
        self.failure_callback = self.called_back.set

    def shutdown(self):
        # SIGKILL lands a moment after kill() returns; vLLM's shutdown() polls
        # every 0.1 s, so one poll's time is allowed.
        time.sleep(0.1)
        emit(peers_alive_at_shutdown=[w.proc.is_alive() for w in self.workers[:-1]])


def run_monitor(path: str, case: dict) -> None:
    import multiprocessing

    start_worker_monitor = extract_worker_monitor(path)
    context = multiprocessing.get_context("fork")
    peer = context.Process(target=stuck_in_a_collective, name="StuckPeer", daemon=True)
    dying = context.Process(target=exits_with_status_1, name="DyingWorker", daemon=True)
    peer.start()
    dying.start()
    executor = StandInExecutor(
        [types.SimpleNamespace(proc=peer), types.SimpleNamespace(proc=dying)], case.get("fault_tolerance")
    )
    try:
        start_worker_monitor(executor)  # its thread waits for a worker to die
        emit(called_back=executor.called_back.wait(CASE_TIMEOUT_SECONDS - 1), is_failed=executor.is_failed)
    finally:
        peer.kill()


# --- the cases ---------------------------------------------------------------


class Outcome:
    def __init__(self, returncode, stdout, stderr, timed_out):
        self.returncode = returncode
        self.events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        self.stderr = stderr
        self.timed_out = timed_out

    @property
    def ran(self):
        return [e["ran"] for e in self.events if "ran" in e]

    @property
    def replies(self):
        return [e for e in self.events if "reply" in e]

    @property
    def escaped(self):
        return [e["escaped"] for e in self.events if "escaped" in e]

    @property
    def drained(self):
        return any(e.get("drained") for e in self.events)

    def error_lines(self):
        return [
            line
            for line in self.stderr.splitlines()
            if line.startswith("ERROR ") and "WorkerProc hit an exception." not in line
        ]

    def __str__(self):
        return f"exit status {self.returncode}, events {self.events}\nstderr:\n{self.stderr}"


def run_case(target, rank=None, calls=(), *, fault_tolerance=None, blocking_teardown=False, monitor=False):
    """One case, in a child Python: the fix ends the process, so a case cannot run in this one."""
    case = {
        "rank": rank,
        "calls": calls,
        "fault_tolerance": fault_tolerance,
        "blocking_teardown": blocking_teardown,
        "monitor": monitor,
    }
    command = [sys.executable, "-I", os.path.abspath(__file__), "--child", target, json.dumps(case)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CASE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return Outcome(None, stdout, stderr, timed_out=True)
    return Outcome(done.returncode, done.stdout, done.stderr, timed_out=False)


def behaviour(target: str) -> str:
    """What a file's worker loop does when a call fails, driven as the tests drive it:
    "exits" (a failing rank that does not answer the call exits with status 1 and sends
    nothing, while the output rank and an all-rank call reply), "replies" (every rank
    replies its own failure, as 0.6.5-0.8.4 do), "drops" (this bug: the failure is
    dropped and the rank serves on), or "unknown" (a loop these cases cannot drive).
    apply.py asks this of a file that no diff fits: `python3 THIS_FILE --behaviour PATH`."""
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
        cls = worker_proc_class(ast.parse(text))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, AssertionError):
        return "unknown"
    setting = False if "enable_fault_tolerance" in text else None  # off, where the file has it
    output_rank = 0 if uses_rank0_only(cls) else 1

    def fail(rank, answered_by):
        return run_case(target, rank, [{"method": "execute_model", "output_rank": answered_by}],
                        fault_tolerance=setting)

    def replied(outcome):
        return (outcome.returncode == 0 and outcome.drained and not outcome.escaped
                and [r["reply"] for r in outcome.replies] == ["failure"])

    if not (replied(fail(output_rank, output_rank)) and replied(fail(0, None))):
        return "unknown"
    other = fail(1 if output_rank == 0 else 0, output_rank)
    if other.returncode == 1 and not other.replies and not other.escaped and not other.timed_out:
        return "exits"
    if replied(other):
        return "replies"
    if other.returncode == 0 and other.drained and not other.replies:
        return "drops"
    return "unknown"


class WorkerLoopTest(unittest.TestCase):
    target: str

    @classmethod
    def setUpClass(cls):
        target = find_target()
        if target is None:
            raise unittest.SkipTest(
                "no vLLM to test: set GAUDI_FIXES_ROOT to the directory holding vllm/, "
                "or install vllm"
            )
        if not os.path.isfile(target):
            raise AssertionError(f"{target} does not exist (GAUDI_FIXES_ROOT points elsewhere?)")
        cls.target = target
        with open(target, encoding="utf-8") as f:
            cls.worker_proc = worker_proc_class(ast.parse(f.read()))
        # A call answered by one rank other than 0, where the release can say so.
        cls.other_output_rank = 0 if uses_rank0_only(cls.worker_proc) else 1

    def run_case(self, rank=None, calls=(), *, fault_tolerance=None, blocking_teardown=False, monitor=False):
        return run_case(self.target, rank, calls, fault_tolerance=fault_tolerance,
                        blocking_teardown=blocking_teardown, monitor=monitor)

    def assert_exited_for(self, outcome, *, rank, method, output_rank, ran):
        self.assertFalse(outcome.timed_out, f"the worker did not end within {CASE_TIMEOUT_SECONDS}s: {outcome}")
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.escaped, [], f"the worker must exit, not raise: {outcome}")
        self.assertEqual(outcome.ran, ran, f"no queued call may run after the failure: {outcome}")
        self.assertEqual(outcome.replies, [], f"a non-output rank must not reply: {outcome}")
        self.assertIn("WorkerProc hit an exception.", outcome.stderr, "the traceback log is kept")
        lines = outcome.error_lines()
        self.assertEqual(len(lines), 1, f"one ERROR line about exiting: {outcome}")
        line = lines[0]
        self.assertRegex(line, rf"(?i)\brank {rank}\b")
        self.assertRegex(line, rf"(?i)\brank {output_rank}\b")
        self.assertIn(method, line)
        self.assertRegex(line, r"(?i)\bexit")

    def test_failing_non_output_rank_exits(self):
        outcome = self.run_case(
            2,
            [
                {"method": "execute_model", "output_rank": 0},
                {"method": "sample_tokens", "output_rank": 0},
            ],
        )
        self.assert_exited_for(outcome, rank=2, method="execute_model", output_rank=0, ran=["execute_model"])

    def test_exit_does_not_wait_for_a_blocked_teardown(self):
        outcome = self.run_case(
            1,
            [
                {"method": "execute_model", "output_rank": 0},
                {"method": "sample_tokens", "output_rank": 0},
            ],
            blocking_teardown=True,
        )
        self.assert_exited_for(outcome, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])

    def test_failing_output_rank_replies_and_goes_on(self):
        rank = self.other_output_rank
        outcome = self.run_case(
            rank,
            [
                {"method": "execute_model", "output_rank": rank},
                {"method": "pickled_step", "output_rank": rank, "pickled": True},
            ],
        )
        self.assertEqual(outcome.returncode, 0, str(outcome))
        self.assertEqual(outcome.ran, ["execute_model", "pickled_step"])
        self.assertEqual(
            outcome.replies,
            [
                {"reply": "failure", "message": "device out of memory during prefill"},
                {"reply": "success", "value": "pickled-ok"},
            ],
        )
        self.assertTrue(outcome.drained)
        self.assertEqual(outcome.error_lines(), [])

    def test_failing_all_rank_call_replies_and_goes_on(self):
        # A call every rank answers that is not a model step (a health check, a LoRA
        # load): each rank replies its failure and serves on; so does rank 0, read
        # first, on a model step every rank answers.
        for rank, failing in ((3, {"method": "failing_pickled_step", "pickled": True}),
                              (0, {"method": "execute_model"})):
            with self.subTest(rank=rank, method=failing["method"]):
                outcome = self.run_case(
                    rank,
                    [
                        {**failing, "output_rank": None},
                        {"method": "pickled_step", "output_rank": None, "pickled": True},
                    ],
                )
                self.assertEqual(outcome.returncode, 0, str(outcome))
                self.assertEqual(outcome.ran, [failing["method"], "pickled_step"])
                self.assertEqual([r["reply"] for r in outcome.replies], ["failure", "success"])
                self.assertTrue(outcome.drained)
                self.assertEqual(outcome.error_lines(), [])

    def test_failing_all_rank_step_replies_then_exits(self):
        # A model step every rank answers (a KV or EC connector): the executor reads
        # rank 0 first, which may wait in a collective for the failed rank. That rank
        # replies its failure, for the engine to end with, then exits.
        if not has_sample_tokens(self.target):
            return  # before 0.11.1 no model step is answered by every rank
        outcome = self.run_case(3, self.step_calls(None))
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.escaped, [], str(outcome))
        self.assertEqual(outcome.ran, ["execute_model"], f"no queued call may run after the failure: {outcome}")
        self.assertEqual(outcome.replies, [{"reply": "failure", "message": "device out of memory during prefill"}])
        [line] = outcome.error_lines() or [str(outcome)]
        self.assertRegex(line, r"\bRank 3 failed execute_model\b.*\bexit")

    def test_failing_all_rank_start_up_call_replies_then_exits(self):
        # A start-up call (warm-up, memory profiling, KV cache set-up) that every rank
        # answers: a rank stuck in a collective with the failed one would hold the
        # server's start for good, as these calls have no timeout.
        if not has_sample_tokens(self.target):
            return  # the fix covers start-up calls from 0.11.1
        outcome = self.run_case(2, [{"method": "compile_or_warm_up_model", "output_rank": None},
                                    {"method": "pickled_step", "output_rank": None, "pickled": True}])
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.ran, ["compile_or_warm_up_model"], str(outcome))
        self.assertEqual(outcome.replies, [{"reply": "failure", "message": "warm-up failed: device out of memory"}])
        [line] = outcome.error_lines() or [str(outcome)]
        self.assertRegex(line, r"\bRank 2 failed compile_or_warm_up_model\b.*\bexit")

    def assert_step_fails_its_sampling(self, outcome, rank):
        """A rank that returned its execute_model failure answers that step's
        sample_tokens with it, without running the runner's, then serves on."""
        self.assertEqual(outcome.returncode, 0, str(outcome))
        self.assertEqual(outcome.ran, ["execute_model", "sample_tokens"], f"a step that never ran is not sampled: {outcome}")
        [exec_reply, sample_reply, next_sample] = outcome.replies or [None, None, None]
        self.assertEqual(exec_reply, {"reply": "failure", "message": "device out of memory during prefill"})
        self.assertEqual(sample_reply["reply"], "failure", str(outcome))
        self.assertIn("device out of memory during prefill", sample_reply["message"], "the worker's own error")
        self.assertRegex(sample_reply["message"], rf"\bexecute_model\b.*\brank {rank}\b")
        self.assertEqual(next_sample, {"reply": "success", "value": "token-7"}, "only that step's sampling fails")
        self.assertTrue(outcome.drained)
        self.assertEqual(outcome.error_lines(), [])

    def step_calls(self, output_rank):
        return [
            {"method": "execute_model", "output_rank": output_rank},
            {"method": "sample_tokens", "output_rank": output_rank},
            {"method": "sample_tokens", "output_rank": output_rank},
        ]

    def test_output_rank_fails_the_steps_sampling(self):
        # Async scheduling and pipeline parallelism read a step's execute_model
        # reply only if sample_tokens returns None; vLLM's V1 runner returns an
        # empty output for a step that never ran.
        if not has_sample_tokens(self.target):
            return  # before 0.11.1 execute_model returns the step's tokens itself
        rank = self.other_output_rank
        self.assert_step_fails_its_sampling(self.run_case(rank, self.step_calls(rank)), rank)

    def test_all_rank_step_fails_its_sampling(self):
        # With a KV or EC connector every rank replies to both calls; rank 0, read
        # first, serves on (a later rank exits: test_failing_all_rank_step_replies_then_exits).
        if not has_sample_tokens(self.target):
            return
        self.assert_step_fails_its_sampling(self.run_case(0, self.step_calls(None)), 0)

    def test_successes_are_unchanged(self):
        calls = [
            {"method": "sample_tokens", "output_rank": 0},
            {"method": "sample_tokens", "output_rank": None},
            {"method": "pickled_step", "output_rank": 0, "pickled": True},
        ]
        on_output_rank = self.run_case(0, calls)
        self.assertEqual(on_output_rank.returncode, 0, str(on_output_rank))
        self.assertEqual(on_output_rank.ran, ["sample_tokens", "sample_tokens", "pickled_step"])
        self.assertEqual(
            on_output_rank.replies,
            [
                {"reply": "success", "value": "token-7"},
                {"reply": "success", "value": "token-7"},
                {"reply": "success", "value": "pickled-ok"},
            ],
        )
        self.assertTrue(on_output_rank.drained)

        elsewhere = self.run_case(1, calls)
        self.assertEqual(elsewhere.returncode, 0, str(elsewhere))
        self.assertEqual(elsewhere.ran, ["sample_tokens", "sample_tokens", "pickled_step"])
        self.assertEqual(elsewhere.replies, [{"reply": "success", "value": "token-7"}])
        self.assertTrue(elsewhere.drained)

    def test_pickled_callable_is_named_by_its_own_name(self):
        outcome = self.run_case(
            1,
            [
                {"method": "sample_tokens", "output_rank": None},
                {"method": "failing_pickled_step", "output_rank": 0, "pickled": True},
                {"method": "sample_tokens", "output_rank": 0},
            ],
        )
        self.assertEqual(outcome.replies, [{"reply": "success", "value": "token-7"}], str(outcome))
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 1, str(outcome))
        self.assertEqual(outcome.ran, ["sample_tokens", "failing_pickled_step"])
        [line] = outcome.error_lines() or [""]
        self.assertIn("failing_pickled_step", line, str(outcome))
        self.assertNotIn("sample_tokens", line, "a name left over from the previous call")

    def test_fault_tolerance_setting(self):
        statements = fault_tolerance_statements(self.worker_proc)
        calls = [
            {"method": "execute_model", "output_rank": 0},
            {"method": "sample_tokens", "output_rank": 0},
        ]
        if not release_has_fault_tolerance(self.target):
            # Releases before 0.27.0 have no such setting: nothing may turn the exit off,
            # and a worker that reads it must not fail for want of it.
            absent = self.run_case(1, calls, fault_tolerance="absent")
            self.assert_exited_for(absent, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])
            return
        self.assertTrue(statements, "WorkerProc.__init__ must read parallel_config.enable_fault_tolerance")
        off = self.run_case(1, calls, fault_tolerance=False)
        self.assert_exited_for(off, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])
        on = self.run_case(1, calls, fault_tolerance=True)
        self.assertEqual(on.returncode, 0, f"with fault tolerance the engine handles the failure: {on}")
        self.assertEqual(on.ran, ["execute_model", "sample_tokens"])
        self.assertEqual(on.replies, [])
        self.assertTrue(on.drained)
        # ... and the output rank samples a failed step as the release does.
        replying = self.run_case(0, self.step_calls(0)[:2], fault_tolerance=True)
        self.assertEqual(replying.ran, ["execute_model", "sample_tokens"], str(replying))
        self.assertEqual([r["reply"] for r in replying.replies], ["failure", "success"], str(replying))

    def assert_monitor(self, fault_tolerance, *, ends_peers):
        outcome = self.run_case(monitor=True, fault_tolerance=fault_tolerance)
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 0, str(outcome))
        [at_shutdown] = [e["peers_alive_at_shutdown"] for e in outcome.events if "peers_alive_at_shutdown" in e] or [None]
        [after] = [e for e in outcome.events if "called_back" in e] or [{}]
        self.assertEqual(after, {"called_back": True, "is_failed": True}, f"the monitor must fail the executor: {outcome}")
        if ends_peers:
            self.assertEqual(at_shutdown, [False], f"the stuck peer must be ended before shutdown(): {outcome}")
        else:
            self.assertEqual(at_shutdown, [True], f"the release's order is kept: {outcome}")

    def test_worker_monitor_ends_the_peers_before_shutdown(self):
        if not release_has_fault_tolerance(self.target):
            self.assert_monitor("absent", ends_peers=True)
            return
        self.assert_monitor(False, ends_peers=True)
        self.assert_monitor(True, ends_peers=False)  # fault tolerance: the release's order


class TimedResponseQueue:
    """One rank's response queue: each reply can be read from its time on (seconds after
    the call); a rank with no reply left is stuck, as in a collective with a dead peer,
    until shutdown() cancels the read (0.20 on: MessageQueue.shutdown(); before: the
    executor's shutdown_event, passed as cancel). Records each read's timeout."""

    def __init__(self, *replies):
        self.replies = list(replies)  # (seconds, (status, value))
        self.started = time.monotonic()
        self.shut_down = False
        self.timeouts = []

    def dequeue(self, timeout=None, cancel=None, indefinite=False):
        self.timeouts.append(timeout)
        if timeout is not None and timeout < 0:
            timeout = 0
        end = time.monotonic() + (CASE_TIMEOUT_SECONDS if timeout is None else timeout)
        while True:
            if self.replies and time.monotonic() - self.started >= self.replies[0][0]:
                return self.replies.pop(0)[1]
            if self.shut_down or (cancel is not None and cancel.is_set()):
                raise RuntimeError("cancelled")
            if time.monotonic() >= end:
                raise TimeoutError
            time.sleep(0.005)

    def shutdown(self):
        self.shut_down = True


class StandInAggregator:
    """A KV or EC connector's aggregator: makes the call one that every rank answers."""

    def aggregate(self, outputs, output_rank=0):
        return list(outputs)


class ExecutorReadTest(unittest.TestCase):
    """The executor's read of a call that every rank answers, from the file's collective_rpc."""

    @classmethod
    def setUpClass(cls):
        target = find_target()
        if target is None:
            raise unittest.SkipTest("no vLLM to test: set GAUDI_FIXES_ROOT or install vllm")
        cls.target = target
        with open(target, encoding="utf-8") as f:
            source = f.read()
        # 0.11.0 and older read each worker's reply through a thread pool: not changed.
        cls.reads_response_mqs = "response_mqs" in source
        cls.collective_rpc = staticmethod(extract_collective_rpc(target)) if cls.reads_response_mqs else None

    def executor(self, *queues, fault_tolerance=False):
        parallel_config = types.SimpleNamespace(enable_fault_tolerance=fault_tolerance)
        return types.SimpleNamespace(
            rpc_broadcast_mq=types.SimpleNamespace(enqueue=lambda request: None),
            response_mqs=list(queues),
            is_failed=False,
            shutdown_event=threading.Event(),
            futures_queue=collections.deque(),
            parallel_config=parallel_config,
            vllm_config=types.SimpleNamespace(parallel_config=parallel_config),
        )

    def call(self, executor, method, timeout, aggregated=True):
        extra = {"kv_output_aggregator": StandInAggregator()} if aggregated else {}
        return self.collective_rpc(executor, method, timeout=timeout, args=(None,), unique_reply_rank=0, **extra)

    def stuck_rank_0_failed_rank_1(self):
        return (
            TimedResponseQueue(),
            TimedResponseQueue((0, (ResponseStatus.FAILURE, "rank 1: device out of memory"))),
        )

    def shut_down_after(self, executor, seconds):
        """What the worker monitor does once the failed rank has exited: shutdown()."""

        def shut_down():
            time.sleep(seconds)
            executor.shutdown_event.set()
            for queue in executor.response_mqs:
                queue.shutdown()

        threading.Thread(target=shut_down, daemon=True).start()

    def test_a_failed_step_ends_with_the_workers_error(self):
        # Rank 1 replied its failure and exited; rank 0 waits in a collective for it
        # until the worker monitor's shutdown() cancels the read. The step ends with
        # rank 1's error, not the cancellation, and so does the step's next call.
        if not self.reads_response_mqs:
            return
        for method in ("execute_model", "sample_tokens"):
            with self.subTest(method=method):
                executor = self.executor(*self.stuck_rank_0_failed_rank_1())
                self.shut_down_after(executor, 0.2)
                for call in (method, "sample_tokens"):
                    with self.assertRaises(Exception) as raised:
                        self.call(executor, call, timeout=5)
                    self.assertIsInstance(raised.exception, RuntimeError, repr(raised.exception))
                    self.assertIn("rank 1: device out of memory", str(raised.exception), call)

    def test_a_healthy_step_reads_each_rank_once(self):
        # The release's read: one dequeue a rank with the call's deadline, never a
        # poll. A poll that gives up between a large reply's slot and its payload
        # (sent over zmq after it) would lose the reply.
        if not self.reads_response_mqs:
            return
        success = ResponseStatus.SUCCESS
        queues = (TimedResponseQueue((0.3, (success, "rank 0"))), TimedResponseQueue((0, (success, "rank 1"))))
        executor = self.executor(*queues)
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0", "rank 1"])
        for rank, queue in enumerate(queues):
            self.assertEqual(len(queue.timeouts), 1, f"rank {rank} read {queue.timeouts}")
            self.assertGreater(queue.timeouts[0], 4, f"rank {rank} read with the call's deadline")

    def test_replies_keep_rank_order_and_step(self):
        if not self.reads_response_mqs:
            return
        success = ResponseStatus.SUCCESS
        executor = self.executor(
            TimedResponseQueue((0.3, (success, "rank 0, step 1")), (0.3, (success, "rank 0, step 2"))),
            TimedResponseQueue((0, (success, "rank 1, step 1")), (0, (success, "rank 1, step 2"))),
        )
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0, step 1", "rank 1, step 1"])
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0, step 2", "rank 1, step 2"])

    def test_other_calls_and_fault_tolerance_keep_the_release_order(self):
        # A failing utility call does not end the engine: its replies are read in rank
        # order, as the release does. Under fault tolerance the engine handles a failed
        # step itself, and reads every rank.
        if not self.reads_response_mqs:
            return
        cases = [("check_health", False)]
        if release_has_fault_tolerance(self.target):
            cases.append(("execute_model", True))
        for method, fault_tolerance in cases:
            with self.subTest(method=method, fault_tolerance=fault_tolerance):
                executor = self.executor(*self.stuck_rank_0_failed_rank_1(), fault_tolerance=fault_tolerance)
                with self.assertRaises(TimeoutError):
                    self.call(executor, method, timeout=0.5)



if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        run_child(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1:2] == ["--behaviour"]:
        print(behaviour(sys.argv[2]))
    else:
        unittest.main()
