"""What the tests share: the bundle's paths, apply.py and the loop test run as an operator
runs them, and a process's state as /proc tells it."""
from __future__ import annotations

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
BUNDLE = os.path.dirname(TESTS)
APPLY = os.path.join(BUNDLE, "apply.py")
INPUTS = os.path.join(TESTS, "inputs")  # test inputs that CI cannot fetch (made from files it can)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# target and patched_bytes import the package where called, as made_from does: the live
# servers import this module with only tests/ on their path.
def target(root: str) -> str:
    """The executor's path in the tree at root."""
    from rank_exception_fatal.outcome import TARGET

    return os.path.join(root, TARGET)


def patched_bytes(version: str, tmp_path) -> bytes:
    """The release file after `git apply` of its diff: what apply.py must write too."""
    from conftest import release_bytes
    from rank_exception_fatal import bundle
    from rank_exception_fatal.outcome import TARGET

    root = tmp_path / f"git-{version}"
    (root / TARGET).parent.mkdir(parents=True, exist_ok=True)
    write(str(root / TARGET), release_bytes(version))
    subprocess.run(["git", "apply", os.path.join(bundle.PATCHES_DIR, f"v{version}.diff")], cwd=root, check=True)
    return read(str(root / TARGET))


def leftovers(root: str) -> list[str]:
    """What a run left beside the executor (its temporary files): nothing, after any run."""
    return sorted(n for n in os.listdir(os.path.dirname(target(root))) if n != "multiproc_executor.py")


def change_a_loop_line(data: bytes) -> bytes:
    """The release file with a line of its worker loop changed: drift that no diff fits."""
    return data.replace(b'logger.exception("WorkerProc hit an exception.")', b'logger.exception("Worker failed.")')


# `python -c UNCHECKED FILE` leaves a .pyc that Python runs without looking at the source
# again: a stale one, once the source is fixed, runs the release's code instead.
UNCHECKED = (
    "import py_compile, sys;"
    "py_compile.compile(sys.argv[1], invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
)


def run_apply(*args: str, python: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """apply.py in a child, with this Python; or, given the Python of a vLLM install, as
    an operator runs it on a node: from /, on the vllm that Python imports, not a tree
    that GAUDI_FIXES_ROOT or PYTHONPATH names for other tests."""
    if python is not None:
        kwargs.setdefault("env", {k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")})
        kwargs.setdefault("cwd", "/")
        kwargs.setdefault("timeout", 600)
    return subprocess.run([python or sys.executable, APPLY, *args], capture_output=True, text=True, **kwargs)


def run_loop_test(root: str, *names: str, fault_tolerance: str | None = None) -> subprocess.CompletedProcess:
    """The bundle's loop test (or the named tests of it) on the tree root, as an operator
    runs it: `GAUDI_FIXES_ROOT=root python -m unittest -v test_rank_exception_fatal`."""
    env = {**os.environ, "GAUDI_FIXES_ROOT": root}
    if fault_tolerance is not None:
        env["RANK_EXCEPTION_FATAL_FAULT_TOLERANCE"] = fault_tolerance
    return subprocess.run([sys.executable, "-m", "unittest", "-v", *(names or ["test_rank_exception_fatal"])],
                          cwd=BUNDLE, env=env, capture_output=True, text=True, timeout=300)


def made_from(diff: str) -> str:
    """The tree whose file a diff was made from: the release it is named after (vX.Y.Z.diff),
    or, for a shape no release has (main-COMMIT.diff, upstream main between releases), the
    first build of releases/builds.tsv that names it."""
    import fetch_release

    if diff.startswith("v"):
        return fetch_release.release_tree(diff[1:-len(".diff")])
    return fetch_release.build_tree(next(build for build in fetch_release.read_builds() if build.diff == diff))


def process_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(its name, the fields after it: state, ppid, pgrp, session...) from /proc/PID/stat;
    None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def put_release_files(root: str, version: str, *, executor: bool = True) -> str:
    """The release's files of the fix into the tree at root: its executor (unless not
    wanted) and its launcher and server file, as the wheel has them. The executor's path."""
    import shutil

    import fetch_release

    tree = fetch_release.release_tree(version)
    executor_file = os.path.join("vllm", "v1", "executor", "multiproc_executor.py")
    for path in [executor_file] * executor + [path for path, _ in fetch_release.exit_path_files(version)]:
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        shutil.copyfile(os.path.join(tree, path), os.path.join(root, path))
    return os.path.join(root, executor_file)


def fix_exit_path(tree: str) -> None:
    """The exit path's files of a release tree fixed as apply.py writes them: for a test of
    the executor's file, which then alone decides the gate's answer."""
    from rank_exception_fatal.exit_path import read_exit_path, write_exit_path

    write_exit_path(tree, read_exit_path(tree), revert=False)


def needs_root() -> None:
    import pytest

    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root; CI runs as root, and fails on a skip")


def run_as_nobody(args: list[str], patches: str) -> int:
    """apply.main in a forked child that dropped root, as an operator without rights would run it."""
    import unidiff  # noqa: F401  (imported as root: the test's venv may lie where nobody cannot read)

    import apply
    from rank_exception_fatal import bundle

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            bundle.PATCHES_DIR = patches
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = apply.main(args)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


# A child that SIGKILLs itself once its Nth write is durable (each write of the bundle's,
# a removal too, ends with the fsync of its directory), then runs the statement: what a
# kill -9 or a power loss at that point leaves on disk. argv: the bundle, N, then the
# statement's own.
KILLED_AFTER_WRITES = """
import os, signal, sys
sys.path[:0] = [sys.argv.pop(1)]
from rank_exception_fatal import disk
synced, writes = disk.sync_directory, int(sys.argv.pop(1))

def sync_then_maybe_die(directory):
    global writes
    synced(directory)
    writes -= 1
    if writes == 0:
        os.kill(os.getpid(), signal.SIGKILL)

disk.sync_directory = sync_then_maybe_die
"""


def killed_after(writes: int, statement: str, *args: str) -> None:
    """Run statement (argv: args) in a child killed after its Nth write; it must have been."""
    import signal

    done = subprocess.run([sys.executable, "-c", KILLED_AFTER_WRITES + statement, BUNDLE, str(writes), *args],
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


# How long a test waits for an event before it calls the wait a hang: never a bound on how
# fast the event comes (a loaded machine is slow, never this slow), only an end to a test
# that would wait forever.
HANG_SECONDS = 900


def wait_for(event, what: str, seconds: float = HANG_SECONDS, every: float = 0.01):
    """Poll event() every so many seconds until it returns a true value, and return that
    value; fail only after seconds, a hang. event may assert, to fail at once on a sign that
    the event cannot come (the process it waits for exited)."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        value = event()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s, a hang"
        time.sleep(every)
