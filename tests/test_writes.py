"""How apply.py writes: through links or not, keeping mode, owner, ACL and extended attributes,
removing stale bytecode, under a lock, and leaving old or new bytes when killed, cut short or
raced by another writer."""
from __future__ import annotations

import json
import os
import py_compile
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apply
import fetch_release
from rank_exception_fatal import change, disk
from rank_exception_fatal.exit_path import HELPER
from conftest import TARGET, release_bytes
from helpers import (APPLY, BUNDLE, HANG_SECONDS, UNCHECKED, fix_exit_path, leftovers, needs_root, patched_bytes, read,
                     run_apply, run_as_nobody, target, wait_for, write)

pytestmark = pytest.mark.usefixtures("no_environment_root")  # the tree each test names, not scripts/test's


def exit_path_paths(version: str) -> list[str]:
    """The paths of a release's launcher and server file in its tree."""
    return [path for path, _ in fetch_release.exit_path_files(version)]


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

        def waiting_for_the_lock() -> bool:
            assert run.poll() is None, "the run finished while another held the lock"
            with open("/proc/locks") as locks:  # "->" marks a process that waits for a lock
                return any(f"-> FLOCK  ADVISORY  WRITE {run.pid} " in line for line in locks)

        wait_for(waiting_for_the_lock, "the run to wait for the lock")
        assert read(path) == release_bytes("0.30.0")
    finally:
        os.close(fd)
    assert run.wait(timeout=HANG_SECONDS) == 0
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


# Runs apply and revert in turn, 12 runs starting with one or the other, and prints their exit
# codes as its last line. Each write of a run (a file replaced or removed) goes to the shared
# log as "RUN begin FILE" and "RUN end FILE", held open a moment between the two, so that two
# runs that wrote at once would interleave there; RUN is pid.turn.apply or pid.turn.revert.
TURNS = """\
import json, os, sys, time
import apply
from rank_exception_fatal import change, disk
root, first, log = os.path.realpath(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
run = None

def note(what):
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, f"{run} {what}\\n".encode())
    finally:
        os.close(fd)

def logged(write):
    def logged_write(path, *args, **kwargs):
        note(f"begin {os.path.relpath(path, root)}")
        time.sleep(0.005)  # a window for another writer, unless the lock keeps it out
        write(path, *args, **kwargs)
        note(f"end {os.path.relpath(path, root)}")
    return logged_write

disk.replace_file = change.replace_file = logged(disk.replace_file)
disk.remove_file = logged(disk.remove_file)
codes = []
for turn in range(12):
    mode = "revert" if (turn + first) % 2 else "apply"
    run = f"{os.getpid()}.{turn}.{mode}"
    codes.append(apply.main(["--root", root, *(["--revert"] if mode == "revert" else [])]))
print(json.dumps(codes))
"""


def tree_files(root: str) -> dict[str, bytes]:
    """Every file under root but a run's temporary ones: {its path in the tree: its bytes}."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            if not name.startswith(disk.TEMP_PREFIX):
                path = os.path.join(directory, name)
                try:
                    files[os.path.relpath(path, root)] = read(path)
                except FileNotFoundError:  # removed by a revert meanwhile
                    pass
    return files


def test_concurrent_applies_and_reverts_serialize(make_tree):
    """8 processes apply and revert one tree at once, 96 runs: every run exits 0 with nothing on
    stderr; each run's writes stand together in the log, whole (every file of the fix) and
    in turn (an apply, then a revert, then an apply...: no run wrote from a state another
    had changed); each file, read again and again meanwhile, holds the release's bytes or the
    fix's, never part of each; and the tree ends whole on the side the last write left it.
    Bounded by that work, not by the clock: only a hang ends the wait."""
    root = make_tree("0.33.0")
    released = tree_files(root)
    fixed_tree = make_tree("0.33.0")
    assert apply.main(["--root", fixed_tree]) == 0
    fixed = tree_files(fixed_tree)
    sides = {path: {released.get(path), fixed.get(path)} for path in {*released, *fixed}}
    assert all(len(side) == 2 for side in sides.values()), "every file of the fix differs between the two sides"
    log = os.path.join(os.path.dirname(root), "writes.log")
    write(log, b"")
    outputs = [os.path.join(os.path.dirname(root), f"run{n}.{stream}") for n in range(8) for stream in ("out", "err")]
    runs = []

    def whole_files_until_all_ended() -> bool:
        ended = all(run.poll() is not None for run in runs)  # before the read: the last state is read too
        now = tree_files(root)
        for path, side in sides.items():
            assert now.get(path) in side, f"{path}: neither the release's bytes nor the fix's"
        return ended

    try:
        for n in range(8):
            with open(outputs[2 * n], "w") as out, open(outputs[2 * n + 1], "w") as err:
                runs.append(subprocess.Popen([sys.executable, "-c", TURNS, root, str(n % 2), log], cwd=BUNDLE,
                                             stdout=out, stderr=err))
        wait_for(whole_files_until_all_ended, "8 processes' 96 applies and reverts", every=0.05)
    finally:  # none left running when the test fails
        for run in runs:
            run.kill()
            run.wait()
    for n, run in enumerate(runs):
        err, out = read(outputs[2 * n + 1]).decode(), read(outputs[2 * n]).decode()
        assert (run.returncode, err) == (0, ""), (n, run.returncode, err)
        assert json.loads(out.splitlines()[-1]) == [0] * 12, (n, out)
    lines = [line.split(" ") for line in read(log).decode().splitlines()]
    blocks = []  # [(run, [its lines])], in the order they were written
    for run, event, path in lines:
        if not blocks or blocks[-1][0] != run:
            blocks.append((run, []))
        blocks[-1][1].append((event, path))
    assert len({run for run, _ in blocks}) == len(blocks), "two runs' writes interleave: the lock did not hold"
    for run, events in blocks:
        paths = [path for _, path in events[::2]]
        assert events == [(event, path) for path in paths for event in ("begin", "end")], (run, events)
        assert sorted(paths) == sorted(sides), f"run {run} wrote some of the fix's files, not all: {paths}"
    modes = [run.rsplit(".", 1)[1] for run, _ in blocks]
    assert modes == ["apply", "revert"] * (len(modes) // 2) + ["apply"] * (len(modes) % 2), modes
    assert len(modes) >= 2, "some runs must have written"
    assert tree_files(root) == (fixed if modes[-1] == "apply" else released)
    assert [name for _, _, names in os.walk(root) for name in names if name.startswith(disk.TEMP_PREFIX)] == []
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
