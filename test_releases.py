"""Every release with the bug, on its own file from PyPI: the bundle fixes it and the fix is proven.

For each release: --check says not applied, apply.py applies, --check says
applied, the stdlib loop test passes on the patched file and fails on the
release file, and --revert gives back the release's bytes. Each diff also
passes the stock tools (git apply, patch -F0) on its own release.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import apply
from conftest import TARGET, release_bytes, release_tree
from fetch_release import RELEASES
from make_diff import make_diff

HERE = os.path.dirname(os.path.abspath(__file__))
DIFFS = sorted(name for name in os.listdir(apply.PATCHES_DIR) if name.endswith(".diff"))


def run_loop_test(root: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "test_rank_exception_fatal"],
        cwd=HERE,
        env={**os.environ, "GAUDI_FIXES_ROOT": root},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("version", RELEASES)
def test_release_is_fixed_and_proven(version, make_tree):
    root = make_tree(version)
    path = os.path.join(root, TARGET)
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0
    assert apply.main(["--root", root, "--check"]) == 0

    patched = run_loop_test(root)
    assert patched.returncode == 0, patched.stderr
    assert re.search(r"^OK$", patched.stderr, re.M), patched.stderr  # "OK (skipped=N)" would not match

    assert apply.main(["--root", root, "--revert"]) == 0
    with open(path, "rb") as f:
        assert f.read() == release_bytes(version)

    pristine = run_loop_test(root)
    assert pristine.returncode == 1, pristine.stderr
    # It fails on what the release does, not on a skip or an import error.
    assert re.search(r"^FAILED \(failures=\d+\)$", pristine.stderr, re.M), pristine.stderr
    assert re.search(r"^test_failing_non_output_rank_exits .*\.\.\. FAIL$", pristine.stderr, re.M), pristine.stderr


@pytest.mark.parametrize("diff", DIFFS)
def test_diff_passes_stock_tools_on_its_release(diff, make_tree):
    version = diff[1:-len(".diff")]
    diff_path = os.path.join(apply.PATCHES_DIR, diff)
    root = make_tree(version)

    def run(*command):
        return subprocess.run(command, cwd=root, capture_output=True, text=True)

    assert run("git", "apply", "--check", "-p1", diff_path).returncode == 0
    dry = run("patch", "-p1", "-F0", "--dry-run", "-i", diff_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not re.search(r"fuzz|offset", dry.stdout + dry.stderr), dry.stdout
    assert run("git", "apply", "-p1", diff_path).returncode == 0
    with open(os.path.join(root, TARGET), encoding="utf-8") as f:
        compile(f.read(), TARGET, "exec")
    assert run("git", "apply", "-R", "-p1", diff_path).returncode == 0
    with open(os.path.join(root, TARGET), "rb") as f:
        assert f.read() == release_bytes(version)


@pytest.mark.parametrize("diff", DIFFS)
def test_diff_carries_whole_functions(diff, make_tree):
    """The committed diff is what make_diff.py writes: its context covers each changed function."""
    version = diff[1:-len(".diff")]
    root = make_tree(version)
    subprocess.run(["git", "apply", os.path.join(apply.PATCHES_DIR, diff)], cwd=root, check=True)
    with open(os.path.join(release_tree(version), TARGET), encoding="utf-8") as f:
        old = f.read()
    with open(os.path.join(root, TARGET), encoding="utf-8") as f:
        new = f.read()
    with open(os.path.join(apply.PATCHES_DIR, diff), encoding="utf-8") as f:
        assert f.read() == make_diff(old, new)


def test_a_future_release_fails_closed(make_tree, capsys):
    """A file that moves the loop's code (as a later vLLM would) is drift, not a guess."""
    root = make_tree("0.33.0")
    path = os.path.join(root, TARGET)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace("            watchdog = get_watch_dog()\n", "            watchdog = get_watch_dog(self.rank)\n"))
    assert apply.main(["--root", root]) == 2
    assert "get_watch_dog(self.rank)" in capsys.readouterr().err
