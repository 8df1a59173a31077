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
import functools
import importlib.util
import inspect
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


# What the stand-in sets on the worker as production's __init__ leaves it (or replaces).
STAND_IN_ATTRIBUTES = frozenset({
    "rank", "worker", "use_async_scheduling", "mm_receiver_cache", "worker_response_mq",
    "rpc_broadcast_mq", "handle_output", "async_output_queue", "async_output_copy_thread",
    "peer_response_handles",
})


def loop_methods(cls: ast.ClassDef) -> set[str]:
    """The methods of WorkerProc that its worker_busy_loop runs: itself and every method
    it reaches through self.NAME."""
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached: set[str] = set()
    todo = ["worker_busy_loop"]
    while todo:
        name = todo.pop()
        if name in reached or name not in methods:
            continue
        reached.add(name)
        todo += [n.attr for n in ast.walk(methods[name]) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in methods]
    return reached


def attributes_read(cls: ast.ClassDef, names: set[str]) -> set[str]:
    """The attributes (not methods) that these methods read off the worker or its class."""
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    read = set()
    for name in names:
        for node in ast.walk(methods[name]):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", cls.name) and isinstance(node.ctx, ast.Load)):
                read.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                read.add(node.args[1].value)
    return read - set(methods)


# Constructors whose new, empty object carries no setting: explicit state of a loop
# (a failed step, pending replies, a flush's event) that __init__ makes.
EMPTY_STATE = {"set", "dict", "list", "tuple", "frozenset", "deque", "Event", "Lock", "RLock", "Queue", "SimpleQueue"}


def plain_value(node: ast.AST) -> bool:
    """A constant, or an empty container or synchronisation object: what __init__ sets
    the same on every worker, whatever the environment."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    if not (isinstance(node, ast.Call) and not node.args and not node.keywords):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id in EMPTY_STATE
    return (isinstance(node.func, ast.Attribute) and node.func.attr in EMPTY_STATE
            and isinstance(node.func.value, ast.Name) and node.func.value.id in ("threading", "queue", "collections"))


def init_settings(tree: ast.Module, cls: ast.ClassDef) -> tuple[list[ast.stmt], str | None]:
    """The class as __init__ leaves it, for what the loop reads: the statements of
    __init__ that set such an attribute to a plain value (run on the stand-in as
    __init__ runs them), and why the loop cannot be judged, if it cannot: an attribute
    the loop reads is set, anywhere in the module but the loop itself, from anything
    but a plain value or fault tolerance (a vendor's switch: its value is unknown)."""
    loop = loop_methods(cls)
    read = attributes_read(cls, loop) - STAND_IN_ATTRIBUTES
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = methods.get("__init__")
    fault_tolerance = fault_tolerance_statements(cls)
    owner: dict[int, ast.AST] = {}  # node -> the innermost function that holds it
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                owner[id(node)] = function
    top_of_init = {id(stmt): stmt for stmt in (init.body if init else [])}
    plain: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            if node.args[1].value in read:
                return plain, f"line {node.lineno} sets {node.args[1].value}, which the loop reads, by setattr"
            continue
        else:
            continue
        for target in targets:
            if not (isinstance(target, ast.Attribute) and target.attr in read):
                continue
            function = owner.get(id(node))
            if function is not None and any(function is methods.get(name) for name in loop):
                continue  # state the loop keeps itself
            if any(node is stmt or any(node is n for n in ast.walk(stmt)) for stmt in fault_tolerance):
                continue  # run as __init__ runs it, with fault tolerance set
            single = isinstance(node, ast.AnnAssign) or (isinstance(node, ast.Assign) and len(node.targets) == 1)
            if (id(node) in top_of_init and single and node.value is not None and plain_value(node.value)
                    and isinstance(target.value, ast.Name) and target.value.id == "self"):
                plain.append(ast.copy_location(ast.Assign(targets=[target], value=node.value), node))
                continue
            return plain, (f"line {node.lineno} sets {target.attr}, which the loop reads, from something other"
                           " than fault tolerance: a switch whose value these cases cannot know")
    return plain, None


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
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            # Class-level defaults (FAIL_FAST_RPCS = frozenset(...) as well as a constant),
            # each as far as the stand-in module can evaluate it: one that names a vLLM
            # type is left out, and a loop that reads it cannot be driven.
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assign = ast.copy_location(ast.Assign(targets=targets, value=node.value), node)
            skip = ast.ExceptHandler(type=ast.Name(id="Exception", ctx=ast.Load()), name=None, body=[ast.Pass()])
            body.append(ast.copy_location(ast.Try(body=[assign], handlers=[skip], orelse=[], finalbody=[]), node))
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
    with open(path, encoding="utf-8") as f:
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


def run_forked(target: str, prepared, case: dict) -> Outcome:
    """One case in a fork of this process, which has the loop extracted already: the
    judgement's matrix is hundreds of cases, and a fresh Python each would take minutes."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            try:
                drive(target, *prepared, case)
            except QueueDrained:
                emit(drained=True)
            except BaseException as e:
                emit(escaped=f"{type(e).__name__}: {e}")
                sys.stdout.flush()
                os._exit(70)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
    os.close(write_end)
    chunks, deadline, timed_out = [], time.monotonic() + CASE_TIMEOUT_SECONDS, False
    import select

    with os.fdopen(read_end, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode("utf-8", "replace")
    return Outcome(None if timed_out else os.waitstatus_to_exitcode(status), text, text, timed_out)


def one_rank_calls(text: str, cls: ast.ClassDef) -> list[dict]:
    """The model steps the executor sends with one output rank, as the file has them:
    execute_model, sample_tokens (0.11.1 on) and execute_dummy_batch where its
    executor sends that. (A pickled callable or a utility call comes from the engine's
    collective_rpc, which every rank answers: those are all-rank calls below.)"""
    calls = [{"method": "execute_model"}]
    if '"sample_tokens"' in text:
        calls.append({"method": "sample_tokens", "fail": ["sample_tokens"]})
    if '"execute_dummy_batch"' in text:
        calls.append({"method": "execute_dummy_batch", "fail": ["execute_dummy_batch"]})
    return calls


ALL_RANK_CALLS = [
    {"method": "execute_model"},  # with a KV or EC connector every rank answers a step
    {"method": "failing_pickled_step", "pickled": True},
    {"method": "check_health", "fail": ["check_health"]},
]
WORLD_SIZE = 4


def behaviour(target: str) -> str:
    """What a file's worker loop does when a call fails, driven as the tests drive it, on
    the class as __init__ leaves it (with fault tolerance off, where the file has it):
    every rank of a world of WORLD_SIZE failing each call the executor sends, with each
    of ERRORS, against output rank 0, 1 and 2, and on calls that every rank answers.

    "exits": for a call with one output rank, every other rank that fails it exits with
    status 1 and sends nothing, and the output rank replies its failure (then goes on
    or exits); every rank replies its failure to a call every rank answers (then goes
    on or exits); a call that succeeds goes on. "replies": a loop whose calls every rank
    answers (before 0.8.5: no output rank at all), where every failing rank replies and
    goes on. "drops": a failure that no one reads, on a rank that goes on (this bug,
    also where a rank replies to a call whose reply the executor does not read).
    "unknown": anything else, a loop these cases cannot drive, or one whose class
    __init__ sets a switch the loop reads from something other than fault tolerance.
    apply.py asks this of a file that no diff fits: `python3 THIS_FILE --behaviour PATH`."""
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
        cls = worker_proc_class(ast.parse(text))
        prepared = prepare(target)
    except Exception:
        return "unknown"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    setting = False if "enable_fault_tolerance" in text else None  # off, where the file has it
    rank0_only = uses_rank0_only(cls)
    every_rank_answers = request_size(cls) == 3
    errors = sorted(ERRORS)

    def run(rank, call, output_rank, error=None, succeed=False):
        step = {"method": "sample_tokens"} if succeed else call
        case = {"rank": rank, "calls": [{**step, "output_rank": output_rank}], "fail": step.get("fail"),
                "fault_tolerance": setting, "error": error}
        return run_forked(target, prepared, case)

    def clean(outcome):
        return not outcome.escaped and not outcome.timed_out

    def replied(outcome):
        # Its failure reaches the caller; the rank may go on, or exit once it has replied.
        return (clean(outcome) and [r["reply"] for r in outcome.replies] == ["failure"]
                and ((outcome.returncode == 0 and outcome.drained) or outcome.returncode == 1))

    def dropped(outcome):
        return clean(outcome) and outcome.returncode == 0 and outcome.drained

    found = set()
    for rank in range(WORLD_SIZE):
        for error in errors:
            for call in ALL_RANK_CALLS:
                found.add("replies" if replied(run(rank, call, None, error)) else "unknown")
    if every_rank_answers:
        return "replies" if found == {"replies"} else "unknown"
    if found != {"replies"}:
        return "unknown"
    output_ranks = [0] if rank0_only else [0, 1, 2]
    for output_rank in output_ranks:
        for rank in range(WORLD_SIZE):
            healthy = run(rank, {}, output_rank, succeed=True)
            expected = [{"reply": "success", "value": "token-7"}] if rank == output_rank else []
            if not (dropped(healthy) and healthy.replies == expected):
                return "unknown"  # a loop that fails healthy calls is no fix
            for call in one_rank_calls(text, cls):
                for error in errors:
                    outcome = run(rank, call, output_rank, error)
                    if rank == output_rank:
                        if not replied(outcome):
                            return "unknown"
                    elif dropped(outcome):
                        return "drops"  # replied to no reader, or not at all, and served on
                    elif not (outcome.returncode == 1 and not outcome.replies and clean(outcome)):
                        return "unknown"
    return "exits"


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
        # From 0.11.1 one get_response() closure reads every reply, from the executor's
        # response_mqs (from its workers' queues on upstream main of 2025-11, vllm-tpu
        # 0.11.2rc1). 0.11.0 and older read each worker's reply in a get_response(w, ...)
        # of their own; their fix leaves that read alone, as a failing rank replies and
        # goes on there. Where it makes that rank exit after its reply (upstream main of
        # 2025-10, vllm-tpu 0.11.1), the read must end with the reply too.
        cls.reads_response_mqs = "def get_response():" in source or (
            "def get_response(\n" in source and "def _after_a_replied_failure(" in source
        )
        cls.collective_rpc = staticmethod(extract_collective_rpc(target)) if cls.reads_response_mqs else None
        parameters = inspect.signature(cls.collective_rpc).parameters if cls.reads_response_mqs else {}
        # A call every rank answers: with a connector's aggregator from 0.11.1, before
        # that with no reply rank (the executor's execute_model aggregated the list).
        cls.takes_aggregator = "kv_output_aggregator" in parameters
        # Before 0.11.1 a model step was not followed by a sample_tokens of its own.
        cls.remembers_a_failed_step = "futures_queue" in source

    def executor(self, *queues, fault_tolerance=False):
        parallel_config = types.SimpleNamespace(enable_fault_tolerance=fault_tolerance)
        return types.SimpleNamespace(
            rpc_broadcast_mq=types.SimpleNamespace(enqueue=lambda request: None),
            response_mqs=list(queues),
            workers=tuple(types.SimpleNamespace(worker_response_mq=queue) for queue in queues),
            io_thread_pool=None,
            is_failed=False,
            shutdown_event=threading.Event(),
            futures_queue=collections.deque(),
            parallel_config=parallel_config,
            vllm_config=types.SimpleNamespace(parallel_config=parallel_config),
        )

    def call(self, executor, method, timeout, aggregated=True, non_block=False):
        """The call's result; with non_block, a future whose result() reads it (before
        0.11.1, where no call is sent ahead, one that makes the call then)."""
        if not self.takes_aggregator:
            reply_rank = None if aggregated else 0
            read = functools.partial(self.collective_rpc, executor, method, timeout=timeout, args=(None,),
                                     unique_reply_rank=reply_rank)
            return types.SimpleNamespace(result=read) if non_block else read()
        extra = {"kv_output_aggregator": StandInAggregator()} if aggregated else {}
        return self.collective_rpc(executor, method, timeout=timeout, args=(None,), unique_reply_rank=0,
                                   non_block=non_block, **extra)

    def stuck_rank_0_failed_rank_1(self):
        return (
            TimedResponseQueue(),
            TimedResponseQueue((0, (ResponseStatus.FAILURE, "rank 1: device out of memory"))),
        )

    def shut_down_after(self, executor, seconds):
        """What the worker monitor does once the failed rank has exited: shutdown()."""

        def shut_down():
            time.sleep(seconds)
            for worker in executor.workers:
                worker.worker_response_mq = None  # as shutdown() does, before it cancels a read
            executor.shutdown_event.set()
            for queue in executor.response_mqs:
                queue.shutdown()

        threading.Thread(target=shut_down, daemon=True).start()

    def test_a_failed_step_ends_with_the_workers_error(self):
        # Rank 1 replied its failure and exited; rank 0 waits in a collective for it
        # until the worker monitor's shutdown() cancels the read. The step ends with
        # rank 1's error, not the cancellation, and so does the step's next call, sent
        # before the shutdown (async scheduling sends it ahead) and read after it.
        if not self.reads_response_mqs:
            return
        for method in ("execute_model", "sample_tokens") if self.remembers_a_failed_step else ("execute_model",):
            with self.subTest(method=method):
                executor = self.executor(*self.stuck_rank_0_failed_rank_1())
                calls = (method, "sample_tokens") if self.remembers_a_failed_step else (method,)
                self.shut_down_after(executor, 0.2)  # the calls below are sent well before it
                sent = [(call, self.call(executor, call, timeout=5, non_block=True)) for call in calls]
                for call, future in sent:
                    with self.assertRaises(Exception) as raised:
                        future.result()
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
