"""--check --pid against real processes, real links and real mount namespaces: the gate
says 0 only when the process runs the fixed file, and answers for a server its manager
restarted and for a systemd-sandboxed one."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import apply
from conftest import TARGET, release_bytes
from helpers import process_stat, put_release_files, read, wait_for

SLEEP = "import time; time.sleep(600)"


def target(root: str) -> str:
    return os.path.join(root, TARGET)


@pytest.fixture(autouse=True)
def no_environment_root(monkeypatch):
    monkeypatch.delenv("GAUDI_FIXES_ROOT", raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", sys.pycache_prefix)  # --pid sets the server's


@pytest.fixture
def start():
    """start(command, cwd="/", env=None) -> the pid of a real process, in a session of its
    own as a service manager starts one; it and its children are ended after the test."""
    started = []

    def run(command: list[str], cwd: str = "/", env: dict | None = None) -> int:
        process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True)
        started.append(process)
        wait_until_started(process.pid)
        return process.pid

    yield run
    for process in started:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def wait_until_started(pid: int, program: str = "python") -> None:
    """Until exec has given the process its program and command line (Popen returns within
    exec, a moment before; unshare and sh exec it a moment later); at once a failure if it
    exited instead. However long that takes on a loaded machine: only a hang fails."""
    def started() -> bool:
        stat = process_stat(pid)
        assert stat is not None and stat[1][0] != "Z", f"process {pid} exited before it started {program}"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return bool(f.read()) and os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(program)
        except FileNotFoundError:
            return False

    wait_for(started, f"process {pid} to start {program}")


def wait_for_pid(path, old: str | None = None) -> str:
    """The pid a process wrote to path (atomically), once it is not old; that process started."""
    wait_for(lambda: path.exists() and path.read_text() != old, f"a new pid in {path}")
    pid = path.read_text()
    wait_until_started(int(pid))
    return pid


def check(pid, capsys) -> tuple[int, dict]:
    """--check --json --pid: (its exit code, its report)."""
    capsys.readouterr()
    code = apply.main(["--pid", str(pid), "--check", "--json"])
    return code, json.loads(capsys.readouterr().out)


def switch_link(link: str, to: str) -> None:
    """Point link at to in one step, as blue/green deploys do: a new link renamed over it."""
    os.symlink(to, link + ".new")
    os.replace(link + ".new", link)


def past_the_margin() -> None:
    time.sleep(0.3)  # past the gate's margin for clock ticks: the next event is clearly later


# --- links on the path the server resolved when it started --------------------------------

@pytest.mark.parametrize("started_by", ["PYTHONPATH", "script"])
def test_a_release_link_switched_after_the_start_needs_a_restart(started_by, make_tree, start, capsys):
    """Blue/green: current -> releases/A (the release's file) when the server started, then
    current -> releases/B (fixed). The path now names B's fixed file, older than the server,
    but the server runs A's code: never 0."""
    a = make_tree("0.30.0", name="srv/releases/A")
    b = make_tree("0.30.0", name="srv/releases/B")
    assert apply.main(["--root", b]) == 0
    srv = os.path.dirname(os.path.dirname(a))
    current = os.path.join(srv, "current")
    os.symlink("releases/A", current)
    for tree in (a, b):
        with open(os.path.join(tree, "serve.py"), "w") as f:
            f.write(SLEEP + "\n")
    server = ([sys.executable, "-c", SLEEP], {"PYTHONPATH": current}) if started_by == "PYTHONPATH" else (
        [sys.executable, os.path.join(current, "serve.py")], {})
    past_the_margin()
    pid = start(server[0], env=server[1])
    assert check(pid, capsys)[0] == 1, "A's file: not applied"
    past_the_margin()
    switch_link(current, "releases/B")
    code, report = check(pid, capsys)
    assert (code, report["state"]) == (1, "needs-restart"), report
    assert f"the link {current} (now to releases/B) last changed" in report["message"], report["message"]
    assert f"process {pid} started at " in report["message"]
    past_the_margin()
    again = start(server[0], env=server[1])
    assert check(again, capsys)[:1] == (0,), "started after the switch: it runs B's fixed file"


def test_a_linked_virtualenv_switched_after_the_start_needs_a_restart(make_tree, start, tmp_path, capsys):
    """/srv/venv -> venvs/1 (the release) when the server started, then -> venvs/2 (fixed):
    the same interpreter, its site-packages found through the link that changed."""
    venvs = tmp_path / "srv" / "venvs"
    sites = []
    for name in ("1", "2"):
        where = str(venvs / name)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", where], check=True)
        site = subprocess.run([os.path.join(where, "bin", "python"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        put_release_files(site, "0.30.0")
        sites.append(site)
    assert apply.main(["--root", sites[1]]) == 0
    venv = str(tmp_path / "srv" / "venv")
    os.symlink("venvs/1", venv)
    past_the_margin()
    pid = start([os.path.join(venv, "bin", "python"), "-c", SLEEP])
    assert check(pid, capsys)[0] == 1
    past_the_margin()
    switch_link(venv, "venvs/2")
    code, report = check(pid, capsys)
    assert (code, report["state"]) == (1, "needs-restart"), report
    assert f"the link {venv} (now to venvs/2) last changed" in report["message"], report["message"]
    past_the_margin()
    assert check(start([os.path.join(venv, "bin", "python"), "-c", SLEEP]), capsys)[0] == 0


# --- which start counts: processes forked without exec, not the server's manager -----------

MANAGER = """\
import os, subprocess, sys, time
pidfile, trigger = sys.argv[1:3]
def serve():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile + ".new", "w") as f:
        f.write(str(child.pid))
    os.replace(pidfile + ".new", pidfile)
    return child
child = serve()
while not os.path.exists(trigger):
    time.sleep(0.01)
child.kill()
child.wait()
serve()
time.sleep(600)
"""


def test_a_server_its_python_manager_restarted_after_the_fix_is_protected(make_tree, start, tmp_path, capsys):
    """supervisord, circus or a Python entrypoint runs the server as a subprocess (fork and
    exec): the manager, older than the fix and of the same session, does not count."""
    tree = make_tree("0.30.0")
    pidfile, trigger = tmp_path / "server.pid", tmp_path / "restart-now"
    manager = start([sys.executable, "-c", MANAGER, str(pidfile), str(trigger)], env={"PYTHONPATH": tree})
    server = wait_for_pid(pidfile)
    assert apply.main(["--pid", server]) == 0
    code, report = check(server, capsys)
    assert (code, report["state"]) == (1, "needs-restart")
    assert f"process {server} started at " in report["message"] and f"process {manager}" not in report["message"]
    past_the_margin()
    trigger.write_text("")
    restarted = wait_for_pid(pidfile, old=server)
    code, report = check(restarted, capsys)
    assert (code, report["state"]) == (0, "applied"), report["message"]


RUNS_ITSELF_AGAIN = """\
import os, subprocess, sys, time
if not os.environ.get("STAND_IN_CHILD"):
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, "STAND_IN_CHILD": "1"})
    time.sleep(600)
with open(sys.argv[1] + ".new", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".new", sys.argv[1])
time.sleep(600)
"""


def test_an_entrypoint_that_runs_itself_again_after_the_fix_is_not_counted_from(make_tree, start, tmp_path, capsys):
    """The same program and command line, but run anew (exec lays out a fresh process, at
    random places): it loaded the file after the fix."""
    with open("/proc/sys/kernel/randomize_va_space") as f:
        assert f.read().strip() != "0", "this machine lays out every exec alike (ASLR off): a fork looks the same"
    tree = make_tree("0.30.0")
    pidfile, trigger = tmp_path / "server.pid", tmp_path / "run-now"
    entry = start([sys.executable, "-c", RUNS_ITSELF_AGAIN, str(pidfile), str(trigger)], env={"PYTHONPATH": tree})
    assert apply.main(["--pid", str(entry)]) == 0
    past_the_margin()
    trigger.write_text("")
    server = wait_for_pid(pidfile)
    assert read(f"/proc/{server}/cmdline") == read(f"/proc/{entry}/cmdline")
    code, report = check(server, capsys)
    assert (code, report["state"]) == (0, "applied"), report["message"]
    code, report = check(entry, capsys)
    assert (code, report["state"]) == (1, "needs-restart") and f"process {entry} started at " in report["message"]


def test_a_worker_forked_after_the_fix_is_counted_from_the_process_it_was_forked_from(make_tree, start, tmp_path,
                                                                                      capsys):
    """A fork without exec inherits its parent's loaded code: the message names that parent."""
    tree = make_tree("0.30.0")
    trigger, child = tmp_path / "fork-now", tmp_path / "child"
    engine = start([sys.executable, "-c", (
        "import os, sys, time\n"
        f"while not os.path.exists({str(trigger)!r}): time.sleep(0.01)\n"
        "pid = os.fork()\n"
        "if pid == 0: time.sleep(600); os._exit(0)\n"
        f"open({str(child)!r} + '.new', 'w').write(str(pid)); os.replace({str(child)!r} + '.new', {str(child)!r})\n"
        "time.sleep(600)\n")], env={"PYTHONPATH": tree})
    assert apply.main(["--pid", str(engine)]) == 0
    past_the_margin()
    trigger.write_text("")
    worker = wait_for_pid(child)
    code, report = check(worker, capsys)
    assert (code, report["state"]) == (1, "needs-restart"), report
    assert f"process {worker} was forked (without exec) from process {engine}, which started at " in report["message"]


# --- mount namespaces: compare the files, not the namespaces ------------------------------

@pytest.fixture
def outside_tmp():
    """A directory that a private /tmp does not hide (PrivateTmp= hides /tmp and /var/tmp)."""
    where = tempfile.mkdtemp(prefix="rank-exception-fatal-", dir="/dev/shm")
    yield where
    shutil.rmtree(where)


def in_a_mount_namespace(start, mounts: str, env: dict) -> int:
    """A Python server in a new mount namespace of its own, after the given mount commands
    (as systemd sets up a sandboxed unit, or a container runtime its container)."""
    assert shutil.which("unshare") and shutil.which("mount"), "util-linux's unshare and mount"
    assert os.geteuid() == 0, "a mount namespace of one's own needs root; CI runs as root"
    script = f"set -e; {mounts}; cd /; exec {sys.executable} -c '{SLEEP}'"
    pid = start(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env)
    wait_until_started(pid)
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    return pid


# What systemd mounts for PrivateTmp=yes, ProtectSystem=full and ProtectHome=read-only.
SANDBOX = ("mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /var/tmp;"
           " for d in /usr /etc /root; do mount --bind $d $d; mount -o remount,bind,ro $d; done")


def test_a_systemd_sandboxed_server_is_checked_and_fixed_as_usual(outside_tmp, start, capsys):
    """Its own mount namespace, but the very same files at the tree's paths."""
    tree = os.path.join(outside_tmp, "tree")
    put_release_files(tree, "0.30.0")
    pid = in_a_mount_namespace(start, SANDBOX, {"PYTHONPATH": tree})
    assert not os.path.samestat(os.stat(f"/proc/{pid}/root/tmp"), os.stat("/tmp")), "its own /tmp"
    code, report = check(pid, capsys)
    assert (code, report["state"], report["path"]) == (1, "not-applied", target(tree)), report
    assert apply.main(["--pid", str(pid)]) == 0
    assert read(f"/proc/{pid}/root{target(tree)}") == read(target(tree)) != release_bytes("0.30.0")
    code, report = check(pid, capsys)
    assert (code, report["state"]) == (1, "needs-restart"), report
    past_the_margin()
    code, report = check(in_a_mount_namespace(start, SANDBOX, {"PYTHONPATH": tree}), capsys)
    assert (code, report["state"]) == (0, "applied"), report


@pytest.mark.parametrize("over", ["the tree's vllm/", "the file alone"])
def test_a_server_that_sees_another_file_at_the_path_is_refused(over, outside_tmp, start, capsys):
    """A container's copy bind-mounted over the host's path: the host's file (fixed) is not
    the one it imports (the release's); neither is checked nor written."""
    host, inside = os.path.join(outside_tmp, "host"), os.path.join(outside_tmp, "container")
    for tree in (host, inside):
        put_release_files(tree, "0.30.0")
    assert apply.main(["--root", host]) == 0
    fixed = read(target(host))
    source, over_path = (target(inside), target(host))
    if over == "the tree's vllm/":
        source, over_path = f"{inside}/vllm", f"{host}/vllm"
    pid = in_a_mount_namespace(start, f"mount -t tmpfs tmpfs /tmp; mount --bind {source} {over_path}",
                               {"PYTHONPATH": host})
    for args in (["--check"], []):
        assert apply.main(["--pid", str(pid), *args]) == 12, args
    code, report = check(pid, capsys)
    assert (code, report["state"]) == (12, "error")
    assert report["message"].startswith(f"process {pid} runs in another mount namespace (a container)"), report
    assert target(host) in report["message"] or f"{host}/vllm" in report["message"], report["message"]
    assert read(target(host)) == fixed and read(target(inside)) == release_bytes("0.30.0")
