"""The real API server of a vLLM install, with a stand-in engine: its exit status.

Run with the install's Python (tests/live_server/test_api_server_exit.py):

    python api_server_exit.py CASES_JSON WORKDIR

It imports the install's run_server (the server file) and the launcher once, then
forks one server per case, which runs run_server(args) under uvloop.run exactly as
`vllm serve` does, with vLLM's own argument parser and setup_server, on a free port
of 127.0.0.1. Only the engine is a stand-in: run_server_worker is replaced by one
that serves a small app through the launcher's real serve_http, whose engine client
the case kills. For each case this process (the parent) does the case's steps
against its server over HTTP and with real signals, waits for it, and prints one
JSON line: {"case", "status", "lines"} (the server's last output lines).

Steps: ready (wait for /health 200); die (a request finds the engine dead: the route
calls the launcher's terminate_if_errored, as vLLM's EngineDeadError handler does);
die-quietly (the engine dies, no request sees it: the launcher's watchdog will);
note:CAUSE (the engine's side writes its cause note, from another process);
term (SIGTERM); health-down (wait until /health is not 200); exit (wait for the exit).
A case's env is set in its server. STAND_IN_NOTE_ON_SHUTDOWN=1: the engine's shutdown
writes a note, as a worker failing while a control-group stop ends it would.
"""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

cases_json, workdir = sys.argv[1:]

import uvloop  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

import vllm.entrypoints.launchers.api_server.entry as entry  # noqa: E402
from vllm.entrypoints.launchers import launcher  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

NOTE_WRITER = """
import sys
from vllm.entrypoints import _rank_exception_fatal as hooks
print(hooks.write_note(sys.argv[1], rank=1, node=0, call="execute_model",
                       exception_type="RuntimeError", exception_message="injected"))
"""


def write_note(cause: str) -> str:
    # Another process, as the engine core and its workers are: it finds the directory
    # through the environment the server exported to the processes it starts.
    notes = notes_of(server_pid)
    if len(notes) != 1:
        return f"not one notes directory: {notes}"
    return subprocess.run([sys.executable, "-c", NOTE_WRITER, cause], capture_output=True, text=True,
                          env=dict(os.environ, RANK_EXCEPTION_FATAL_NOTES=notes[0])).stdout.strip()


class StandInEngine:
    """What the launcher and the exit path read of vLLM's AsyncLLM: errored and is_running
    (a dead engine: errored and not running, as after its output handler ended), the
    shutdown timeout, and shutdown(), after which a clean stop reads as dead too."""

    def __init__(self) -> None:
        self.errored, self.is_running = False, True
        self.vllm_config = type("Config", (), {"shutdown_timeout": 0})()

    def die(self) -> None:
        self.errored, self.is_running = True, False

    def shutdown(self, timeout=None) -> None:
        if os.environ.get("STAND_IN_NOTE_ON_SHUTDOWN") == "1":
            from vllm.entrypoints import _rank_exception_fatal as hooks
            hooks.write_note("rank-failed", rank=1, call="execute_model", exception_type="RuntimeError",
                             exception_message="peer gone while stopping")
        self.die()


async def stand_in_worker(listen_address, sock, args, client_config=None, **uvicorn_kwargs) -> None:
    """run_server_worker's tail as the release has it, around a stand-in engine."""
    engine = StandInEngine()
    app = FastAPI()
    app.state.engine_client = engine

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=503 if engine.errored else 200)

    @app.post("/die")
    async def die(request: Request):
        engine.die()
        launcher.terminate_if_errored(request.app.state.server, engine)
        return JSONResponse({"error": "EngineDeadError"}, status_code=500)

    @app.post("/die-quietly")
    async def die_quietly():
        engine.die()
        return JSONResponse({})

    shutdown_task = await launcher.serve_http(app, sock=sock, enable_ssl_refresh=False, host=args.host,
                                              port=args.port, log_level="warning")
    try:
        await shutdown_task
    finally:
        sock.close()


def notes_of(pid: int) -> list[str]:
    """The notes directories of the server with this pid: arm() names each one by its
    user and pid and a random tail."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return glob.glob(os.path.join(base, f"rank-exception-fatal-{os.getuid()}-{pid}-*"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, port: int, path: str):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def wait_exit(pid: int, timeout: float):
    """The server's exit status as the shell gives it (a signal N as -N), or None if it is still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(wait_status)
        time.sleep(0.05)
    return None


for case in json.loads(cases_json):
    port = free_port()
    log = os.path.join(workdir, f"{case['name']}.log")
    server_pid = os.fork()
    if server_pid == 0:
        # The server: its output to the case's log, then `vllm serve`'s own call.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(case.get("env", {}))
        entry.run_server_worker = stand_in_worker
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["--model", "stand-in", "--host", "127.0.0.1", "--port", str(port)])
        uvloop.run(entry.run_server(args))
        sys.exit(0)
    status, steps = None, []
    for step in case["steps"]:
        if step == "ready":
            ok = wait_for(lambda: http("GET", port, "/health") == 200, 60)
        elif step in ("die", "die-quietly"):
            ok = http("POST", port, "/" + step) is not None
        elif step.startswith("note:"):
            ok = write_note(step[len("note:"):]) == "True"
        elif step == "term":
            os.kill(server_pid, signal.SIGTERM)
            ok = True
        elif step == "health-down":
            ok = wait_for(lambda: http("GET", port, "/health") != 200, 10)
        elif step == "exit":
            status = wait_exit(server_pid, 30)
            ok = status is not None
        else:
            raise SystemExit(f"unknown step {step!r}")
        steps.append([step, ok])
        if not ok:
            break
    if status is None:
        os.kill(server_pid, signal.SIGKILL)
        os.waitpid(server_pid, 0)
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    print(json.dumps({"case": case["name"], "status": status, "steps": steps, "lines": lines[-40:],
                      "notes_left": bool(notes_of(server_pid))}), flush=True)
