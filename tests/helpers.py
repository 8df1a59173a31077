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
