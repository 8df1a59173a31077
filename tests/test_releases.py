"""Every release with the bug, on its own file from PyPI: the bundle fixes it and the fix is proven.

The releases, their files' sha256 and their diffs come from releases/releases.tsv.
For each release: --check says not applied with the diff the table names,
apply.py applies, --check says applied, the stdlib loop test passes on the
patched file (both fault-tolerance settings where the release has one) and
fails on the release file, and --revert gives back the release's bytes. Each
diff also passes the stock tools (git apply, patch -F0) on every one of its
releases, and is what make_diff.py writes for the release it is named after.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

import apply
from rank_exception_fatal import bundle, check, decide
from conftest import TARGET, release_bytes, release_tree
from helpers import APPLY, BUNDLE, made_from, run_loop_test
import fetch_release
from fetch_release import RELEASES, TABLE_ROWS
from make_diff import make_diff
from test_rank_exception_fatal import has_sample_tokens, runs_on_several_nodes

DIFFS = sorted(name for name in os.listdir(bundle.PATCHES_DIR) if name.endswith(".diff"))
# (diff, release) for every release in the table: each diff is checked on each of its releases.
DIFF_RELEASES = [(release.diff, release.version) for release in TABLE_ROWS.values()]
if os.environ.get("RANK_EXCEPTION_FATAL_RELEASES") == "named":
    # scripts/test runs every release under one Python and, under the others, the release
    # each diff is named after: what varies with Python is apply.py and the loop test's
    # reading of the file, and each diff's shape is there once.
    RELEASES = tuple(version for version in RELEASES if TABLE_ROWS[version].diff == f"v{version}.diff")
    DIFF_RELEASES = [(diff, version) for diff, version in DIFF_RELEASES if version in RELEASES]
# Releases whose file is byte for byte the same (0.8.5 and 0.8.5.post1, six of 0.9.x and 0.10.x...) with the
# same fault-tolerance setting are one case: the same bytes, run once (the sha256 that releases/releases.tsv
# gives each is checked on its own file when it is fetched).
SAME_FILE: dict[tuple[str, str], list[str]] = {}
for version in RELEASES:
    SAME_FILE.setdefault((TABLE_ROWS[version].sha256, TABLE_ROWS[version].fault_tolerance), []).append(version)
RELEASE_FILES = [versions[0] for versions in SAME_FILE.values()]
RELEASE_IDS = ["+".join(versions) for versions in SAME_FILE.values()]


def run_release_loop_test(root: str, version: str) -> subprocess.CompletedProcess:
    """The loop test on root, with the release's fault-tolerance setting as the table says."""
    return run_loop_test(root, fault_tolerance=TABLE_ROWS[version].fault_tolerance)


ALL_BUILDS = fetch_release.read_builds()


def test_table_and_bundle_agree():
    """Every diff fixes some listed release or real build, and is named after a release it fixes
    or, if it fixes none, after the upstream commit of the build it was made from."""
    assert set(DIFFS) == {release.diff for release in TABLE_ROWS.values()} | {build.diff for build in ALL_BUILDS}
    for diff in DIFFS:
        if diff.startswith("v"):
            assert TABLE_ROWS[diff[1:-len(".diff")]].diff == diff, diff
        else:
            commit = re.fullmatch(r"main-([0-9a-f]{8})\.diff", diff).group(1)
            assert any(build.diff == diff and f" {commit} " in f" {build.what} " for build in ALL_BUILDS), diff


def test_each_release_is_decided_by_its_text_as_by_its_hash():
    """--check decides a known file by its sha256 without parsing a diff; parsed, the same
    file fits the same diff and no other (a diff for upstream main between releases among them)."""
    fixes = bundle.read_bundle()
    for version in RELEASE_FILES:
        decision = decide.decide(release_bytes(version).decode("utf-8"), fixes)
        assert (decision.state, decision.fix.name) == ("not-applied", TABLE_ROWS[version].diff), version
        assert check.decide_by_hash(release_bytes(version)).fix.name == TABLE_ROWS[version].diff, version


def test_readme_summary_says_what_the_table_says():
    """README's first screen: the range of releases, how many, and how many diffs."""
    with open(os.path.join(BUNDLE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    versions = list(TABLE_ROWS)
    summary = f"vLLM {versions[0]} through {versions[-1]}, post-releases included: {len(versions)} releases,"
    assert f"{summary} {len(DIFFS)} diffs" in readme


def test_release_page_lists_what_the_table_says():
    """docs/releases.md's table, the one operators read, names each release's diff as the table does."""
    with open(os.path.join(BUNDLE, "docs", "releases.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Releases") :]
    listed = {}
    for row in re.findall(r"^\| (\d[^|]*) \| `patches/(v[^`]+\.diff)`", section, re.M):
        for version in row[0].split(", "):
            listed[version] = row[1]
    assert listed == {version: release.diff for version, release in TABLE_ROWS.items()}


# The loop test mostly waits (for a rank's exit, a stuck peer's deadline), so the runs of
# every release are started together, four at a time (each case has CASE_TIMEOUT_SECONDS;
# two cores), and each release's test reads its own.
LOOP_RUNS_AT_ONCE = 4


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """version -> (run on the file apply.py fixed, its sha256, run on the release's file): futures."""

    base = tmp_path_factory.mktemp("loop-runs")  # mktemp itself is not safe across threads

    def both(version: str) -> tuple[subprocess.CompletedProcess, str, subprocess.CompletedProcess]:
        fixed, release = (str(base / f"{state}-{version}") for state in ("fixed", "release"))
        for root in (fixed, release):
            shutil.copytree(os.path.join(release_tree(version), "vllm"), os.path.join(root, "vllm"))
        applied = subprocess.run([sys.executable, APPLY, "--root", fixed],
                                 capture_output=True, text=True)
        assert applied.returncode == 0, applied.stderr
        with open(os.path.join(fixed, TARGET), "rb") as f:
            fixed_sha256 = hashlib.sha256(f.read()).hexdigest()
        return run_release_loop_test(fixed, version), fixed_sha256, run_release_loop_test(release, version)

    with ThreadPoolExecutor(LOOP_RUNS_AT_ONCE) as pool:
        runs: dict[str, Future] = {version: pool.submit(both, version) for version in RELEASE_FILES}
        yield runs
        for run in runs.values():
            run.cancel()


@pytest.mark.parametrize("version", RELEASE_FILES, ids=RELEASE_IDS)
def test_release_is_fixed_and_proven(version, make_tree, loop_runs, capsys):
    root = make_tree(version)
    path = os.path.join(root, TARGET)
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["diff"] == TABLE_ROWS[version].diff, "the diff that releases/releases.tsv names"
    assert apply.main(["--root", root]) == 0
    assert apply.main(["--root", root, "--check"]) == 0
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == TABLE_ROWS[version].fixed_sha256, "the table's fixed_sha256"
    patched, loop_tested_sha256, pristine = loop_runs[version].result()
    assert loop_tested_sha256 == TABLE_ROWS[version].fixed_sha256, "the loop test ran on these bytes"

    assert patched.returncode == 0, patched.stderr
    assert re.search(r"^OK$", patched.stderr, re.M), patched.stderr  # "OK (skipped=N)" would not match
    # Where the release has the setting, both settings were run and passed.
    assert re.search(r"^test_fault_tolerance_setting .*\.\.\. ok$", patched.stderr, re.M), patched.stderr

    assert apply.main(["--root", root, "--revert"]) == 0
    with open(path, "rb") as f:
        assert f.read() == release_bytes(version)

    assert pristine.returncode == 1, pristine.stderr
    # It fails on what the release does, not on a skip or an import error.
    assert re.search(r"^FAILED \(failures=\d+\)$", pristine.stderr, re.M), pristine.stderr
    assert re.search(r"^test_failing_non_output_rank_exits .*\.\.\. FAIL$", pristine.stderr, re.M), pristine.stderr
    if has_sample_tokens(path):
        # The output rank's failed step is sampled as if it had run (async scheduling, PP).
        assert re.search(r"^test_output_rank_fails_the_steps_sampling .*\.\.\. FAIL$", pristine.stderr, re.M)
        assert re.search(r"^test_all_rank_step_fails_its_sampling .*\.\.\. FAIL$", pristine.stderr, re.M)
        # A rank other than 0 that fails a step every rank answers serves on, and a read
        # that shutdown() cancels ends with the cancellation, not the worker's failure.
        assert re.search(r"^test_failing_all_rank_step_replies_then_exits .*\.\.\. FAIL$", pristine.stderr, re.M)
        assert re.search(r"^test_failing_all_rank_start_up_call_replies_then_exits .*\.\.\. FAIL$", pristine.stderr, re.M)
        assert re.search(r"^FAIL: test_a_failed_step_ends_with_the_workers_error ", pristine.stderr, re.M)
    if runs_on_several_nodes(path):
        # Multi-node (0.11.1 on): a failure on another node reaches the engine only at the
        # RPC timeout, a node's lost worker is not seen, and a headless node exits 0.
        for test in ("test_a_rank_on_another_node_replies_its_failure_then_exits",
                     "test_a_headless_node_exits_non_zero_when_a_worker_dies",
                     "test_a_worker_lost_on_another_node_ends_the_step",
                     "test_a_read_of_another_node_ends_with_the_executor"):
            assert re.search(rf"^FAIL: {test} ", pristine.stderr, re.M), (test, pristine.stderr)


# Real builds between releases (releases/builds.tsv): every one under 3.12; under the other
# Pythons (the named matrix) the first, as each diff's release already runs under them.
BUILDS = ALL_BUILDS[:1] if os.environ.get("RANK_EXCEPTION_FATAL_RELEASES") == "named" else ALL_BUILDS


@pytest.mark.parametrize("build", BUILDS, ids=[fetch_release.build_name(b) for b in BUILDS])
def test_a_real_build_between_releases_is_fixed_and_proven(build, tmp_path, capsys):
    """Upstream main at a nightly or a vllm-gaudi pin, a vendor's build: the file is not a
    release's, the gate still knows it (its diff exactly, or adapted and proven before the
    write), and the fix on it passes the loop test."""
    root = str(tmp_path / "tree")
    shutil.copytree(fetch_release.build_tree(build), root)
    path = os.path.join(root, TARGET)
    with open(path, "rb") as f:
        build_bytes = f.read()
    assert hashlib.sha256(build_bytes).hexdigest() not in {r.sha256 for r in TABLE_ROWS.values()}, "not a release's"
    assert apply.main(["--root", root, "--exact", "--executor-only", "--check"]) == (1 if build.fits == "exactly" else 2)
    capsys.readouterr()
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["diff"], report["adapted"]) == (build.diff, build.fits == "adapted"), report
    assert apply.main(["--root", root]) == 0
    capsys.readouterr()
    # The gate runs the loop test on a fixed file the table does not know, and says so.
    assert apply.main(["--root", root, "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "proven by the loop test" in report["message"], report
    assert apply.main(["--root", root, "--revert"]) == 0
    with open(path, "rb") as f:
        assert f.read() == build_bytes


@pytest.mark.parametrize("diff, version", DIFF_RELEASES)
def test_diff_passes_stock_tools_on_its_releases(diff, version, make_tree):
    diff_path = os.path.join(bundle.PATCHES_DIR, diff)
    root = make_tree(version)

    def run(*command):
        return subprocess.run(command, cwd=root, capture_output=True, text=True)

    assert run("git", "apply", "--check", "-p1", diff_path).returncode == 0
    dry = run("patch", "-p1", "-F0", "--dry-run", "-i", diff_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "fuzz" not in dry.stdout + dry.stderr, dry.stdout
    if diff == f"v{version}.diff":
        # A sibling release may hold the same functions a few lines away; the diff's own may not.
        assert "offset" not in dry.stdout + dry.stderr, dry.stdout
    assert run("git", "apply", "-p1", diff_path).returncode == 0
    with open(os.path.join(root, TARGET), encoding="utf-8") as f:
        compile(f.read(), TARGET, "exec")
    assert run("git", "apply", "-R", "-p1", diff_path).returncode == 0
    with open(os.path.join(root, TARGET), "rb") as f:
        assert f.read() == release_bytes(version)


EXACT_BUILDS = [build for build in ALL_BUILDS if build.fits == "exactly"]


@pytest.mark.parametrize("build", EXACT_BUILDS, ids=[fetch_release.build_name(b) for b in EXACT_BUILDS])
def test_diff_passes_stock_tools_on_its_builds(build, tmp_path):
    """As on the releases: a build's diff applies with git apply and patch -F0, without fuzz,
    and without offset on the build it was made from. (An adapted build's is placed by apply.py
    alone: its diff's whole functions differ there.)"""
    root = os.path.join(str(tmp_path), "tree")
    shutil.copytree(fetch_release.build_tree(build), root)
    diff_path = os.path.join(bundle.PATCHES_DIR, build.diff)
    dry = subprocess.run(["patch", "-p1", "-F0", "--dry-run", "-i", diff_path], cwd=root, capture_output=True, text=True)
    assert dry.returncode == 0 and "fuzz" not in dry.stdout, dry.stdout + dry.stderr
    if made_from(build.diff) == fetch_release.build_tree(build):
        assert "offset" not in dry.stdout, dry.stdout
    assert subprocess.run(["git", "apply", "--check", "-p1", diff_path], cwd=root).returncode == 0


@pytest.mark.parametrize("diff", DIFFS)
def test_diff_carries_whole_functions(diff, tmp_path):
    """The committed diff is what make_diff.py writes: its context covers each changed function."""
    source = made_from(diff)
    root = os.path.join(str(tmp_path), "tree")
    shutil.copytree(source, root)
    subprocess.run(["git", "apply", os.path.join(bundle.PATCHES_DIR, diff)], cwd=root, check=True)
    with open(os.path.join(source, TARGET), encoding="utf-8") as f:
        old = f.read()
    with open(os.path.join(root, TARGET), encoding="utf-8") as f:
        new = f.read()
    with open(os.path.join(bundle.PATCHES_DIR, diff), encoding="utf-8") as f:
        assert f.read() == make_diff(old, new)


def test_a_future_release_fails_closed(make_tree, capsys):
    """A file that moves the loop's code (as a later vLLM would) is drift, not a guess."""
    root = make_tree("0.33.0")
    path = os.path.join(root, TARGET)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace("            watchdog = get_watch_dog()\n", "            watchdog = get_watch_dog(self.rank)\n"))
    with open(path, "rb") as f:
        drifted = f.read()
    assert apply.main(["--root", root]) == 2
    assert "source drifted" in capsys.readouterr().err
    with open(path, "rb") as f:
        assert f.read() == drifted, "nothing is written"


# --- fetching ---------------------------------------------------------------------


def test_fetch_falls_back_to_the_sdist_where_ranges_are_refused(monkeypatch):
    release = TABLE_ROWS["0.8.5"]  # its sdist holds the same file, and is 7 MB
    assert release.sdist == "same"
    expected = release_bytes("0.8.5")

    def refuse(self, index):
        raise fetch_release.RangeNotHonoured("this host sends whole files")

    monkeypatch.setattr(fetch_release.RemoteFile, "block", refuse)
    assert fetch_release.fetch(release) == expected


def test_a_file_unlike_the_table_is_refused(monkeypatch):
    monkeypatch.setattr(fetch_release, "read_from_wheel", lambda *args, **kwargs: b"not the release's file\n")
    with pytest.raises(ValueError, match="releases/releases.tsv"):
        fetch_release.fetch(TABLE_ROWS["0.30.0"])


def test_a_damaged_cached_file_is_fetched_again(tmp_path, monkeypatch):
    expected = release_bytes("0.30.0")
    monkeypatch.setenv("RANK_EXCEPTION_FATAL_CACHE", str(tmp_path))
    cached = tmp_path / "releases" / "0.30.0" / TARGET
    cached.parent.mkdir(parents=True)
    cached.write_bytes(expected[:1000])  # a copy cut short
    fetched = []
    monkeypatch.setattr(fetch_release, "read_from_wheel", lambda name, **kwargs: fetched.append(name) or expected)
    assert fetch_release.release_tree("0.30.0") == str(tmp_path / "releases" / "0.30.0")
    assert cached.read_bytes() == expected and fetched == [TABLE_ROWS["0.30.0"].wheel]
    fetch_release.release_tree("0.30.0")
    assert len(fetched) == 1, "a whole cached file is not fetched again"


def test_survey_gives_the_table_row(tmp_path, monkeypatch):
    """The table's data is what --survey reads off PyPI (here for the first release, whose sdist is small)."""
    monkeypatch.setenv("RANK_EXCEPTION_FATAL_CACHE", str(tmp_path))
    release = TABLE_ROWS["0.8.5"]
    row = (release.version, release.sha256, release.fault_tolerance, release.wheel, release.sdist)
    assert fetch_release.survey("0.8.5") == "\t".join(row)
