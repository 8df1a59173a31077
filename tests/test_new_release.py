"""scripts/new_release.py on real releases, each in a copy of the bundle whose table ends
before it (so that it is new there): 0.33.0 fits its diff exactly and the row written is
the table's own; 0.23.0 takes 0.20.0's diff by adaptation, proven, and gets a diff of its
own written; 0.34.0's FutureWrapper grew poll()/wait_briefly(), so it needs a hand-made
diff; and the errors are one line.

The runs are started together (they mostly wait for the loop test), as a maintainer runs
the script: python3 scripts/new_release.py VERSION [--write] --bundle COPY.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TARGET, release_tree
from helpers import BUNDLE, put_release_files
from fetch_release import TABLE_ROWS, cache_dir
from make_diff import make_diff, seal_table
from new_release import row_line, version_key
from rank_exception_fatal.table import read_releases

SCRIPT = os.path.join(BUNDLE, "scripts", "new_release.py")


def bundle_before(root: str, version: str, *, keep_diff: bool) -> str:
    """A copy of the bundle at root whose table lists only releases older than version;
    the diffs of the rows left out are gone too, but for version's own when keep_diff."""
    os.makedirs(root)
    for name in ("apply.py", "test_rank_exception_fatal.py"):
        shutil.copy2(os.path.join(BUNDLE, name), root)
    for name in ("rank_exception_fatal", "patches", "releases"):
        shutil.copytree(os.path.join(BUNDLE, name), os.path.join(root, name),
                        ignore=shutil.ignore_patterns("__pycache__"))
    table = os.path.join(root, "releases", "releases.tsv")
    with open(table, encoding="utf-8") as f:
        lines = f.readlines()[1:]  # less the seal
    kept = []
    for line in lines:
        fields = line.split("\t")
        if line.startswith("#") or fields[0] == "version" or version_key(fields[0]) < version_key(version):
            kept.append(line)
        elif not (keep_diff and fields[0] == version) and os.path.exists(os.path.join(root, "patches", fields[1])):
            os.remove(os.path.join(root, "patches", fields[1]))
    with open(table, "w", encoding="utf-8") as f:
        f.write("".join(kept))
    seal_table(table)
    return root


def run_script(*args: str, bundle: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args, "--bundle", bundle],
                          capture_output=True, text=True, timeout=300)


# name -> (version, keep its diff, --write, bundle copy or None for the repo itself)
CASES = {
    "0.33.0": ("0.33.0", True, False),
    "0.33.0-write": ("0.33.0", True, True),
    "0.33.0-without-its-diff": ("0.33.0", False, True),
    "0.34.0": ("0.34.0", False, True),
    "0.23.0-write": ("0.23.0", False, True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (the bundle copy, the script's run on it), started four at a time."""
    base = tmp_path_factory.mktemp("new-release")

    def one(name: str):
        version, keep_diff, write = CASES[name]
        bundle = bundle_before(str(base / name), version, keep_diff=keep_diff)
        return bundle, run_script(version, *(["--write"] if write else []), bundle=bundle)

    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(one, name) for name in CASES}
        yield futures
        for future in futures.values():
            future.cancel()


def table_text(bundle: str) -> str:
    with open(os.path.join(bundle, "releases", "releases.tsv"), encoding="utf-8", newline="") as f:
        return f.read()


def fixed_by_apply(bundle: str, version: str, root: str) -> tuple[int, dict, bytes]:
    """apply.py --exact --check --json, then apply.py, of the bundle on a copy of the release's
    file: (the check's exit status, its report, the fixed file)."""
    path = put_release_files(root, version)
    apply = os.path.join(bundle, "apply.py")
    check = subprocess.run([sys.executable, apply, "--root", root, "--exact", "--check", "--json"],
                           capture_output=True, text=True)
    assert subprocess.run([sys.executable, apply, "--root", root], capture_output=True).returncode == 0
    with open(path, "rb") as f:
        return check.returncode, json.loads(check.stdout), f.read()


def test_a_release_that_fits_a_diff_exactly_gets_the_tables_own_row(runs):
    bundle, done = runs["0.33.0"].result()
    before = table_text(bundle)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "nearest in the table: 0.32.0 (patches/v0.32.0.diff)" in out
    assert "  read path: changed " in out and "MultiprocExecutor.collective_rpc.get_response" in out
    assert "  worker loop: changed " in out and "WorkerProc._execute_worker_rpc" in out
    assert "  elsewhere: " in out and "ExceptionWithKVConnectorOutput.__init__ (added)" in out
    assert "fits patches/v0.33.0.diff exactly: add the row with that diff" in out
    assert "proven: the loop test passes on the fixed file" in out
    assert "git apply --check and patch -p1 -F0 --dry-run take it" in out
    assert f"would add to releases/releases.tsv and seal it: {row_line(TABLE_ROWS['0.33.0'])}\n" in out
    assert table_text(bundle) == before, "without --write nothing is written"


def test_write_adds_the_tables_own_row_and_seals_the_table(runs):
    bundle, done = runs["0.33.0-write"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    table = table_text(bundle)
    written = read_releases(table)  # sealed, whole, agreeing with itself
    assert row_line(written["0.33.0"]) == row_line(TABLE_ROWS["0.33.0"])
    assert list(written)[-1] == "0.33.0"
    assert not [name for name in os.listdir(os.path.join(bundle, "releases")) if name.startswith(".")], "no temp file left"
    assert run_script("0.33.0", bundle=bundle).returncode == 2, "listed now"


def test_a_release_no_diff_can_be_placed_on_needs_a_diff_of_its_own(runs):
    bundle, done = runs["0.33.0-without-its-diff"].result()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no diff can be placed by adaptation either" in done.stdout
    assert "needs a diff of its own: edit a copy, then make_diff" in done.stdout
    assert "0.33.0" not in read_releases(table_text(bundle)), "nothing written"
    assert not os.path.exists(os.path.join(bundle, "patches", "v0.33.0.diff"))


def test_an_adapted_release_gets_a_new_diff_proven_and_written(runs, tmp_path):
    bundle, done = runs["0.23.0-write"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "nearest in the table: 0.22.1 (patches/v0.20.0.diff)" in out
    assert "  read path: unchanged\n" in out and "  monitor: changed MultiprocExecutor.shutdown\n" in out
    assert "patches/v0.20.0.diff is placed by adaptation" in out
    assert "proven: the loop test passes on the fixed file (enable_fault_tolerance no)" in out
    assert "wrote patches/v0.23.0.diff" in out
    row = read_releases(table_text(bundle))["0.23.0"]
    assert (row.diff, row.sha256, row.fault_tolerance) == ("v0.23.0.diff", TABLE_ROWS["0.23.0"].sha256, "no")
    # The new diff fits its release exactly, makes the row's fixed file, and is make_diff's.
    status, report, fixed = fixed_by_apply(bundle, "0.23.0", str(tmp_path / "tree"))
    assert (status, report["diff"], report["adapted"]) == (1, "v0.23.0.diff", False)
    assert hashlib.sha256(fixed).hexdigest() == row.fixed_sha256
    with open(os.path.join(release_tree("0.23.0"), TARGET), encoding="utf-8") as f:
        release = f.read()
    with open(os.path.join(bundle, "patches", "v0.23.0.diff"), encoding="utf-8", newline="") as f:
        assert f.read() == make_diff(release, fixed.decode("utf-8"))


def test_a_release_whose_future_grew_methods_needs_a_diff_of_its_own(runs):
    """vLLM 0.34.0: FutureWrapper.poll()/wait_briefly() and two new arguments to the future.
    0.33.0's diff still places, but the loop test does not read through poll()."""
    bundle, done = runs["0.34.0"].result()
    before = read_releases(table_text(bundle))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "nearest in the table: 0.33.0 (patches/v0.33.0.diff)" in out
    assert "  read path: added FutureWrapper.poll, FutureWrapper.wait_briefly" in out
    assert "FutureWrapper.__init__ takes new arguments response_ready, wait_for_response" in out
    assert "FutureWrapper(...) takes new arguments response_ready, wait_for_response" in out
    assert "  worker loop: unchanged\n" in out and "  monitor: unchanged\n" in out
    assert "patches/v0.33.0.diff is placed by adaptation" in out
    assert "the bundle's loop test may not drive this: new in the read path: FutureWrapper.poll" in out
    assert "needs a diff of its own: edit a copy, then make_diff" in out
    release_file = os.path.join(cache_dir(), "releases", "0.34.0", TARGET)  # where the survey put it
    assert f"python3 scripts/make_diff.py {release_file} " in out and "> patches/v0.34.0.diff" in out
    assert "python3 scripts/new_release.py 0.34.0 --write" in out
    assert "python3 scripts/supersede.py" in out and "pytest tests/test_releases.py -k 0.34.0" in out
    assert read_releases(table_text(bundle)).keys() == before.keys() and "0.34.0" not in before, "nothing written"
    assert not os.path.exists(os.path.join(bundle, "patches", "v0.34.0.diff"))


def test_errors_are_one_line_with_status_2():
    listed = run_script("0.32.0", bundle=BUNDLE)  # already in the table: before any fetch or write
    unknown = run_script("9.9.9", bundle=BUNDLE)  # no such release on the index
    for done in (listed, unknown):
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr.startswith("new_release.py: ") and done.stderr.count("\n") == 1, done.stderr
    assert "already in releases/releases.tsv" in listed.stderr
