"""The worker loop and the executor's code, taken out of the file with ast and bound to
stand-ins, without importing vLLM; and what the file says of its release (fault
tolerance, sample_tokens, the request's shape).

Every release shape from 0.8.5 on: the loop inline in WorkerProc.worker_busy_loop or
calling WorkerProc._execute_worker_rpc; replying through handle_output or straight
onto worker_response_mq; reading the call's output rank, or 0.8.5's rank0_only flag."""
from __future__ import annotations

import ast
import contextlib
import logging
import os
import pickle
import sys
import types

from ..bindings import bound_names, loop_methods

LOGGER_NAME = "vllm.v1.executor.multiproc_executor"


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
            with open(config, encoding="utf-8-sig") as f:
                return any(line.startswith("    enable_fault_tolerance") for line in f)
    with open(target, encoding="utf-8-sig") as f:
        return "enable_fault_tolerance" in f.read()


def has_sample_tokens(target: str) -> bool:
    """Whether the executor sends sample_tokens after execute_model (0.11.1 and later)."""
    with open(target, encoding="utf-8-sig") as f:
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
    with open(path, encoding="utf-8-sig") as f:
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


# What start_worker_monitor calls on its executor in a fixed file: the fix's watch of
# the workers on other nodes (multi-node releases).
MONITOR_METHODS = ("start_worker_monitor", "_watch_remote_workers")


def extract_worker_monitor(path: str) -> dict:
    """MultiprocExecutor.start_worker_monitor from the file, and the executor's methods
    it calls that the file has (MONITOR_METHODS), as plain functions by name."""
    with open(path, encoding="utf-8-sig") as f:
        tree = ast.parse(f.read(), filename=path)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MultiprocExecutor"]
    functions = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in MONITOR_METHODS]
    for function in functions:
        strip_annotations(function)
    module = ast.Module(body=[*stdlib_imports(tree), *functions], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace = {"__name__": "multiproc_executor_under_test", "logger": logging.getLogger(LOGGER_NAME),
                 # A fixed monitor tells the API server of a dead worker through WorkerProc.
                 "WorkerProc": extract_worker_proc(path)[0]}
    exec(compile(module, path, "exec"), namespace)
    return {function.name: namespace[function.name] for function in functions}


def runs_across_nodes(text: str) -> bool:
    """Whether the file's executor runs across nodes (--nnodes, 0.11.1 on), by any of the
    names that shape has: a vendor's file that renames one is still taken for what it is."""
    return any(name in text for name in ("peer_worker_response_mqs", "nnodes", "node_rank"))


def future_reads(tree: ast.Module) -> set[str]:
    """The names FutureWrapper's class body binds (its reads of a call's result)."""
    return {name for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "FutureWrapper"
            for item in node.body for name in bound_names(item)}


def handle_fields(tree: ast.Module) -> set[str]:
    """The fields of the file's WorkerProcHandle (a dataclass)."""
    return {item.target.id for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "WorkerProcHandle"
            for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}


def extract_collective_rpc(path: str):
    """MultiprocExecutor.collective_rpc and the FutureWrapper it returns, from the file
    (0.11.1 on, where replies come through the executor's response_mqs)."""
    with open(path, encoding="utf-8-sig") as f:
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
