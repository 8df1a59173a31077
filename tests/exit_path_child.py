"""A stand-in API server for tests/test_exit_path.py: it runs the exit-path module (the
helper diff's file, under ROOT) through one sequence of hooks, as a real run_server,
launcher and signal handler would call them, and exits as the module makes it exit.

    python exit_path_child.py ROOT STEP [STEP ...]

Steps: arm; dead / alive / retired (the engine's state from now on: the release's
errored and is_running, or elastic EP's retirement); layout:VERSION (where the client
holds its engine core processes, as that release's core_client.py does: 0.8.5, 0.9.0,
or 0.9.1 and later, the default); core:CODE (the engine core process ended with CODE,
or "running"), core:ending:CODE (no status yet: it ends with CODE when joined),
core:closed (reading its status raises, as a closed multiprocessing.Process's does); broken (reading the engine's state raises); checked
(terminate_if_errored's hook); stop (the signal handler's hook); serve-stop (the signal
handler's hook called in a running event loop that then waits, as uvicorn waits for its
connections: the engine client stops 0.2 s later and its open requests get what the hook
gives them; the loop never ends by itself); serve-stop-raise (the same, but the loop
raises 0.2 s after the engine client stopped, as a run_server that fails, and the
interpreter's exit then takes a second); say (print what the exit would say: the
verdict); handler-failed (vLLM's output handler logging its end, as it does when the
engine core ends under it); note:CAUSE[:STATUS]
(a cause note written by another process, as the engine's side writes it, with this
process's environment); sleep:SECONDS; fork (a child forked now exits normally, running
the atexit calls it inherits); exit (run_server's last call). vLLM's logger is set up
as vLLM sets it up, a handler on "vllm" writing to stdout, unless the first step is
"no-vllm-logging" (no handler anywhere) or "root-logging" (vLLM's logging off, a handler
on the root logger writing to stdout).
"""
import json
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

root, *steps = sys.argv[1:]
sys.path.insert(0, root)
from vllm.entrypoints import _rank_exception_fatal as hooks  # noqa: E402

if steps[:1] == ["no-vllm-logging"]:
    steps = steps[1:]
elif steps[:1] == ["root-logging"]:
    steps = steps[1:]
    logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
else:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    vllm_logger.propagate = False


class Process:
    """An engine core process as multiprocessing shows it to its parent: its exitcode
    (None while it runs; closed, reading it raises), and join, which waits out the
    timeout, or returns once a process that is ending has its status."""

    def __init__(self, exitcode, ending: bool = False, closed: bool = False) -> None:
        self._exitcode, self.ending, self.closed = exitcode, ending, closed

    @property
    def exitcode(self):
        if self.closed:
            raise ValueError("process object is closed")
        return None if self.ending else self._exitcode

    def join(self, timeout=None) -> None:
        if self.ending:
            time.sleep(0.2)
            self.ending = False
        else:
            time.sleep(timeout or 0)


def resources(layout: str, processes: list) -> SimpleNamespace:
    """The client's resources, as each release's vllm/v1/engine/core_client.py holds them."""
    if layout == "0.8.5":
        return SimpleNamespace(core_engines=[SimpleNamespace(proc_handle=SimpleNamespace(proc=p)) for p in processes])
    manager = SimpleNamespace(processes=processes)
    return SimpleNamespace(local_engine_manager=manager) if layout == "0.9.0" else SimpleNamespace(engine_manager=manager)


class Engine:
    """What the hooks read of vLLM's AsyncLLM: errored, is_running, elastic EP's flag, and
    the engine core processes through its client (engine_core.resources)."""

    broken = False
    layout = "0.9.1"

    def __init__(self) -> None:
        self._errored, self.is_running, self.should_keep_api_server_alive = False, True, False
        self.engine_core = SimpleNamespace(resources=resources(self.layout, []))

    @property
    def errored(self) -> bool:
        if self.broken:
            raise RuntimeError("the engine client's state cannot be read")
        return self._errored


engine = Engine()
app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
WRITER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from vllm.entrypoints import _rank_exception_fatal as hooks
print(hooks.write_note(**json.loads(sys.argv[2])))
"""
for step in steps:
    if step == "arm":
        hooks.arm()
        print("notes", hooks._state["notes"], flush=True)
    elif step in ("dead", "alive", "retired"):
        engine._errored, engine.is_running = step != "alive", step == "alive"
        engine.should_keep_api_server_alive = step == "retired"
    elif step.startswith("layout:"):
        engine.layout = step[len("layout:"):]
    elif step.startswith("core:"):
        code = step[len("core:"):]
        if code == "closed":
            process = Process(None, closed=True)
        elif code.startswith("ending:"):
            process = Process(int(code[len("ending:"):]), ending=True)
        else:
            process = Process(None if code == "running" else int(code))
        engine.engine_core.resources = resources(engine.layout, [process])
    elif step == "broken":
        engine.broken = True
    elif step == "checked":
        hooks.engine_checked(engine)
    elif step == "stop":
        hooks.stop_requested(app)
    elif step == "handler-failed":  # vLLM's AsyncLLM output handler meeting the engine's end
        try:
            raise RuntimeError("EngineCore is gone")
        except RuntimeError:
            logging.getLogger("vllm.v1.engine.async_llm").exception("AsyncLLM output_handler failed.")
    elif step == "say":
        print("verdict", hooks._say_why(), flush=True)
    elif step in ("serve-stop", "serve-stop-raise"):
        import asyncio
        import atexit

        hooks.ANSWER_GRACE_SECONDS = 0.5
        # What the hook imports to answer the open requests, as vLLM has it.
        exceptions = SimpleNamespace(EngineDeadError=type("EngineDeadError", (Exception,), {}))
        sys.modules.update({"vllm.v1": SimpleNamespace(), "vllm.v1.engine": SimpleNamespace(),
                            "vllm.v1.engine.exceptions": exceptions})
        engine.output_processor = SimpleNamespace(propagate_error=lambda e: print("answered", type(e).__name__,
                                                                                  flush=True))

        async def serving() -> None:
            hooks.stop_requested(app)
            await asyncio.sleep(0.2)
            engine.is_running = False  # abort mode: the client's output handler is cancelled
            if step == "serve-stop-raise":
                await asyncio.sleep(0.2)
                atexit.register(time.sleep, 1.0)  # the interpreter's exit outlasts the hook's grace
                raise RuntimeError("run_server failed")
            await asyncio.Event().wait()  # uvicorn waiting for connections that never close

        try:
            asyncio.run(serving())
        except RuntimeError as e:
            print(e, flush=True)
            sys.exit(1)
    elif step.startswith("note:"):
        cause, _, status = step[len("note:"):].partition(":")
        note = {"cause": cause, "rank": 1, "node": 0, "call": "execute_model",
                "exception_type": "RuntimeError", "exception_message": "CUDA error: out of memory\nsecond line"}
        if status:
            note.update(call=None, exception_type=None, exception_message=None, worker_exit_status=int(status))
        written = subprocess.run([sys.executable, "-c", WRITER, root, json.dumps(note)], capture_output=True,
                                 text=True, check=True).stdout.strip()
        print("note written", written, flush=True)
        time.sleep(0.01)  # the monotonic clock moves on before the next step
    elif step.startswith("sleep:"):
        time.sleep(float(step[len("sleep:"):]))
    elif step == "fork":
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a normal exit: the atexit calls run
        os.waitpid(child, 0)
        print("after the fork, notes", os.path.isdir(hooks._state["notes"]), flush=True)
    elif step == "exit":
        hooks.exit_if_engine_died()
        print("returned", flush=True)
    else:
        raise SystemExit(f"unknown step {step!r}")
