"""--pid on a stand-in server: the gate answers for the copy of vLLM the running process imports
(from its checkout, PYTHONPATH, virtualenv, script or pycache prefix), and reads 0 only once it
runs the fix."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import apply
from rank_exception_fatal import running
from conftest import TARGET
from helpers import (UNCHECKED, fix_exit_path, needs_root, patched_bytes, process_stat, put_release_files, read,
                     run_apply, run_as_nobody, target, wait_for, write)

pytestmark = pytest.mark.usefixtures("no_environment_root")  # the tree each test names, not scripts/test's


SLEEP = "import time; time.sleep(600)"


@pytest.fixture
def server_stand_in():
    """start(cwd, env, command) -> the pid of a real Python process, started as a server may
    be (by default `python -c`: its working directory first on sys.path), in a session of its
    own as a service manager starts one; ended after the test."""
    started = []

    def start(cwd: str, env: dict | None = None, command: list[str] | None = None) -> int:
        process = subprocess.Popen(command or [sys.executable, "-c", SLEEP], cwd=cwd,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        started.append(process)
        wait_until_started(process.pid)
        return process.pid

    yield start
    for process in started:
        process.kill()
        process.wait()


def wait_until_started(pid: int) -> None:
    """Until exec has given the process its command line: Popen returns within exec, a
    moment before. At once a failure if it exited instead; else only a hang fails."""
    def started() -> bool:
        stat = process_stat(pid)
        assert stat is not None and stat[1][0] != "Z", f"process {pid} exited before it started"
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read())

    wait_for(started, f"process {pid} to start")


@pytest.fixture
def venv(tmp_path) -> tuple[str, str]:
    """(its python, its site-packages): a real virtualenv, made by `python -m venv`, whose
    bin/python is a link to the base interpreter."""
    where = str(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", where], check=True)
    python = os.path.join(where, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, site


def install_release(site: str, version: str) -> str:
    """A release's real files of the fix in site (a site-packages or any directory on
    sys.path): the executor's path."""
    return put_release_files(site, version)


def test_the_gate_answers_for_the_copy_a_running_server_imports(make_tree, server_stand_in, capsys):
    """The gate's Python finds one vLLM; the server, started from a checkout or with its own
    PYTHONPATH, imports another. --pid checks and fixes the server's."""
    installed = make_tree("0.30.0", name="site-packages")
    checkout = make_tree("0.30.0", name="checkout")
    elsewhere = make_tree("0.26.0", name="on-its-pythonpath")
    assert apply.main(["--root", installed]) == 0
    capsys.readouterr()
    from_checkout = server_stand_in(checkout)
    with_pythonpath = server_stand_in("/", {"PYTHONPATH": elsewhere})
    for pid, tree, version in ((from_checkout, checkout, "0.30.0"), (with_pythonpath, elsewhere, "0.26.0")):
        assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["path"] == target(tree)
        assert apply.main(["--pid", str(pid)]) == 0
        assert f"applied patches/v{version}.diff" in capsys.readouterr().out
        assert apply.main(["--pid", str(pid), "--check"]) == 1, "it runs the code it loaded"
        assert capsys.readouterr().out.startswith("needs restart: the fix reads applied")
    # Run from the checkout, the gate says that a server started there imports another copy.
    done = run_apply("--check", cwd=checkout, env={**os.environ, "PYTHONPATH": installed})
    assert done.returncode == 0 and f"note: {target(checkout)} would be imported instead" in done.stderr


def restarted(server_stand_in, *args) -> int:
    """A server started again, after the change (past the gate's margin for clock ticks)."""
    time.sleep(0.3)
    return server_stand_in(*args)


def test_the_gate_answers_for_the_running_server(make_tree, server_stand_in, capsys):
    """--check --pid: 0 only when the running process started after the fix was written."""
    tree = make_tree("0.30.0")
    pid = server_stand_in("/", {"PYTHONPATH": tree})
    assert apply.main(["--pid", str(pid), "--check"]) == 1
    assert apply.main(["--pid", str(pid)]) == 0
    capsys.readouterr()
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["state"], report["exit_code"], report["diff"]) == ("needs-restart", 1, "v0.30.0.diff")
    assert report["message"].startswith(f"needs restart: the fix reads applied (applied (patches/v0.30.0.diff); the exit path applied),"
                                        f" but process {pid} started at ")
    assert apply.main(["--pid", str(pid), "--check"]) == 1
    assert capsys.readouterr().out.startswith("needs restart: ")
    assert apply.main(["--check", "--root", tree]) == 0, "the file alone is fixed"
    capsys.readouterr()
    again = restarted(server_stand_in, "/", {"PYTHONPATH": tree})
    assert apply.main(["--pid", str(again), "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "applied"
    assert apply.main(["--pid", str(pid), "--check"]) == 1, "the old one still runs the old code"


def test_a_server_started_within_the_margin_of_the_change_needs_a_restart(make_tree, server_stand_in, monkeypatch,
                                                                         capsys):
    """A start and a change too close together to order: when unsure, not 0."""
    tree = make_tree("0.30.0")
    assert apply.main(["--root", tree]) == 0
    time.sleep(0.3)
    pid = server_stand_in("/", {"PYTHONPATH": tree})
    assert apply.main(["--pid", str(pid), "--check"]) == 0
    # As if the clocks were that coarse: an hour, longer than any loaded machine takes from the write to the start.
    monkeypatch.setattr(running, "RESTART_MARGIN", 3600.0)
    capsys.readouterr()
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "needs-restart" and "within 3600 s after" in report["message"], report


def test_a_server_started_before_stale_bytecode_was_removed_needs_a_restart(make_tree, server_stand_in, tmp_path, capsys):
    """The source fixed, the release's unchecked .pyc beside it: apply removes the .pyc and
    writes nothing, but the server that loaded it runs the release's code until restarted."""
    tree = make_tree("0.30.0")
    fix_exit_path(tree)
    subprocess.run([sys.executable, "-c", UNCHECKED, target(tree)], check=True)
    write(target(tree), patched_bytes("0.30.0", tmp_path))
    pid = server_stand_in("/", {"PYTHONPATH": tree})
    time.sleep(0.3)  # the file's last write is well before the server's start
    assert apply.main(["--pid", str(pid), "--check"]) == 1
    assert capsys.readouterr().out.startswith("stale bytecode ")
    assert apply.main(["--pid", str(pid), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["action"] == "none" and "removed stale bytecode" in report["message"]
    assert read(target(tree)) == patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "needs-restart"
    again = restarted(server_stand_in, "/", {"PYTHONPATH": tree})
    assert apply.main(["--pid", str(again), "--check"]) == 0


@pytest.mark.parametrize("args, code", [
    (["--pid", "abc"], 6), (["--pid"], 6), (["--pid", "1", "--root", "/"], 6), (["--pid", "1", "--verify"], 6),
    (["--pid", "999999999"], 3),
])
def test_pid_errors(args, code, capsys):
    assert apply.main(args) == code
    err = capsys.readouterr().err
    assert err.startswith("apply.py: ") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("started_as", ["path", "name-on-its-PATH", "relative"])
def test_pid_of_a_server_in_a_virtualenv(started_as, venv, server_stand_in, tmp_path, capsys):
    """/proc/PID/exe names the base interpreter that the venv's bin/python links to; the
    server imports from the venv's site-packages, found by the path it was started by."""
    python, site = venv
    path = install_release(site, "0.30.0")
    bin_dir = os.path.dirname(python)
    argv0, cwd, env = {
        "path": (python, "/", {}),
        "name-on-its-PATH": ("python", "/", {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}),
        "relative": (os.path.join("bin", "python"), os.path.dirname(bin_dir), {}),
    }[started_as]
    pid = server_stand_in(cwd, env, [argv0, "-c", SLEEP])
    assert os.path.realpath(f"/proc/{pid}/exe") != python and os.path.islink(python)
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["path"] == path
    assert apply.main(["--pid", str(pid)]) == 0
    assert read(path) == patched_bytes("0.30.0", tmp_path)


def test_pid_of_a_process_whose_title_hides_its_interpreter(venv, tmp_path, capsys):
    """A title set in place of the command line (vLLM names its engine and workers so):
    which venv the process runs in cannot be told, and the base interpreter's packages are
    not what it imports."""
    python, site = venv
    install_release(site, "0.30.0")
    titled = subprocess.Popen(["VLLM::EngineCore", "-c", SLEEP], executable=python, start_new_session=True)
    try:
        wait_until_started(titled.pid)
        assert apply.main(["--pid", str(titled.pid), "--check"]) == 3
        err = capsys.readouterr().err
        assert "but its command line does not name it ('VLLM::EngineCore'" in err and len(err.splitlines()) == 1
    finally:
        titled.kill()
        titled.wait()


def test_pid_of_a_server_whose_working_directory_was_removed(make_tree, server_stand_in, tmp_path, capsys):
    tree = make_tree("0.30.0")
    gone = tmp_path / "gone"
    gone.mkdir()
    pid = server_stand_in(str(gone), {"PYTHONPATH": tree})
    gone.rmdir()
    assert os.readlink(f"/proc/{pid}/cwd").endswith(" (deleted)")
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["path"] == target(tree)
    assert apply.main(["--pid", str(pid)]) == 0
    assert read(target(tree)) == patched_bytes("0.30.0", tmp_path)


@pytest.mark.parametrize("form", ["directory", "zip"])
def test_pid_of_a_server_run_as_a_directory_or_zip(form, make_tree, server_stand_in, tmp_path, capsys):
    """`python /srv/app`: CPython puts /srv/app itself first on sys.path (a zip too), not
    /srv, where a fixed copy stands beside it."""
    srv = make_tree("0.30.0", name="srv")
    assert apply.main(["--root", srv]) == 0  # /srv/vllm: fixed
    app = tmp_path / "app"
    install_release(str(app), "0.30.0")  # /srv/app/vllm: vendored, the release's
    (app / "__main__.py").write_text(SLEEP + "\n")
    script = str(app)
    if form == "zip":
        script = shutil.make_archive(str(tmp_path / "app"), "zip", app)
        shutil.rmtree(app)
    shutil.move(script, srv)
    script = os.path.join(srv, os.path.basename(script))
    capsys.readouterr()
    pid = server_stand_in("/", None, [sys.executable, script])
    if form == "directory":
        assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["path"] == os.path.join(script, TARGET)
    else:
        assert apply.main(["--pid", str(pid), "--check"]) == 10
        assert f"Python imports vllm's executor from {script}/{TARGET}" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["-X pycache_prefix=DIR", "-Xpycache_prefix=DIR"])
def test_pid_of_a_server_with_a_pycache_prefix_on_its_command_line(given, make_tree, server_stand_in, tmp_path, capsys):
    """The release's unchecked .pyc under the prefix the server's -X option names would run."""
    tree = make_tree("0.30.0")
    prefix = tmp_path / "pycache"
    option = given.replace("DIR", str(prefix)).split(" ")
    subprocess.run([sys.executable, *option, "-c", UNCHECKED, target(tree)], check=True)
    [pyc] = [os.path.join(d, n) for d, _, names in os.walk(prefix) for n in names]
    write(target(tree), patched_bytes("0.30.0", tmp_path))
    pid = server_stand_in("/", {"PYTHONPATH": tree}, [sys.executable, *option, "-c", SLEEP])
    assert apply.main(["--pid", str(pid), "--check"]) == 1
    assert capsys.readouterr().out.startswith(f"stale bytecode {pyc} would run instead of the fixed source")
    assert apply.main(["--pid", str(pid)]) == 0 and not os.path.exists(pyc)


def test_pid_of_a_process_that_is_not_python_or_not_ours(server_stand_in, public_tree, capfd):
    """Held: a non-Python process, and another user's, are refused with their own codes."""
    needs_root()
    _, patches = public_tree
    not_python = server_stand_in("/", None, ["sleep", "600"])
    assert apply.main(["--pid", str(not_python), "--check"]) == 3
    err = capfd.readouterr().err
    assert f"process {not_python} runs {os.path.realpath(shutil.which('sleep'))}, not Python" in err and len(err.splitlines()) == 1
    roots = server_stand_in("/")  # root's server, checked by a user without rights
    assert run_as_nobody(["--pid", str(roots), "--check"], patches) == 4
    err = capfd.readouterr().err
    assert f"cannot read process {roots}: Permission denied; run as its user or as root" in err, err
