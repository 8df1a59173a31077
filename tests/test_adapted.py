"""Adapted files on the real bytes of vLLM 0.34.0, whose executor reads a step through
FutureWrapper.poll() as no release before it did: a node an earlier bundle adapted is
upgraded, never read as drift; an adaptation is proven on every read the file has, when
it is written and again when the gate reads it; and a read no proof drives is drift."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import TARGET, release_bytes
from fetch_release import TABLE_ROWS
from helpers import APPLY, BUNDLE, put_release_files, read, write
from rank_exception_fatal import bundle
from rank_exception_fatal.adapt import narrowed
from rank_exception_fatal.decide import decide_any
from rank_exception_fatal.match import rewrite, split_lines
from rank_exception_fatal.seal import HEADER, seal

NEW = "0.34.0"  # the release whose read path changed
BUNDLE_PARTS = ("apply.py", "rank_exception_fatal", "patches", "releases", "test_rank_exception_fatal.py")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run(apply_py: str, root: str, *args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, apply_py, "--root", root, *args, "--json"], capture_output=True,
                          text=True, timeout=600)
    return done.returncode, json.loads(done.stdout)


def bundle_without_the_new_diff(into) -> str:
    """This bundle as it was before it had a diff for NEW: its apply.py, whose table ends
    with the release before (sealed again) and whose patches/ lacks that diff."""
    into.mkdir()
    for part in BUNDLE_PARTS:
        source = os.path.join(BUNDLE, part)
        (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, str(into / part))
    os.remove(into / "patches" / TABLE_ROWS[NEW].diff)
    table = into / "releases" / "releases.tsv"
    _, _, body = table.read_text(encoding="utf-8").partition("\n")
    body = "".join(line for line in body.splitlines(True) if not line.startswith(f"{NEW}\t"))
    table.write_text(seal(body), encoding="utf-8")
    assert table.read_text(encoding="utf-8").startswith(HEADER)
    return str(into / "apply.py")


def last_bundle(tmp_path) -> str:
    """The bundle of the commit before the one that added NEW's diff: what operators ran."""
    added = subprocess.run(["git", "-C", BUNDLE, "log", "--diff-filter=A", "--format=%H", "--",
                            f"patches/{TABLE_ROWS[NEW].diff}"], capture_output=True, text=True, check=True)
    commit = added.stdout.split()[-1]
    into = tmp_path / "last-bundle"
    into.mkdir()
    archive = subprocess.run(["git", "-C", BUNDLE, "archive", f"{commit}~1", *BUNDLE_PARTS], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return str(into / "apply.py")


def test_a_node_the_last_bundle_adapted_is_upgraded(make_tree, tmp_path):
    # The last bundle had no diff for NEW: it placed its v0.33.0.diff there by its own
    # lines, proved it with its loop test (which never polled) and wrote it. Today's
    # bundle changed that diff, so the file is neither a known file nor today's fix.
    root = make_tree(NEW)
    code, report = run(last_bundle(tmp_path), root)
    assert (code, report["adapted"]) == (0, True), report
    adapted = read(os.path.join(root, TARGET))
    for args in ((), ("--exact",)):  # the text before it is the release's, byte for byte
        code, report = run(APPLY, root, "--check", *args)
        assert (code, report["state"], report["diff"]) == (1, "not-applied", TABLE_ROWS[NEW].diff), report
        assert "an earlier bundle's fix (patches/" in report["message"], report
    code, report = run(APPLY, root, "--diff")
    assert code == 0 and report["sha256_before"] == sha256(adapted), report
    assert read(os.path.join(root, TARGET)) == adapted, "--diff writes nothing"
    code, report = run(APPLY, root)
    assert code == 0 and sha256(read(os.path.join(root, TARGET))) == TABLE_ROWS[NEW].fixed_sha256, report
    assert run(APPLY, root, "--check")[0] == 0
    write(os.path.join(root, TARGET), adapted)
    code, report = run(APPLY, root, "--revert")
    assert code == 0 and read(os.path.join(root, TARGET)) == release_bytes(NEW), report


def test_today_s_earlier_diff_placed_where_a_diff_of_its_own_now_fits_is_upgraded(make_tree):
    # The same file as an operator of a bundle with today's v0.33.0.diff but no diff for
    # NEW would have: the fix's lines stand (adapted), yet NEW has a diff of its own now.
    root = make_tree(NEW)
    [older] = [fix for fix in bundle.read_bundle() if fix.name == TABLE_ROWS["0.33.0"].diff]
    placed = rewrite(split_lines(release_bytes(NEW).decode()), narrowed(older)[0]).encode()
    write(os.path.join(root, TARGET), placed)
    code, report = run(APPLY, root, "--check")
    assert (code, report["diff"]) == (1, TABLE_ROWS[NEW].diff), report
    assert f"patches/{older.name}" in report["message"], report
    assert run(APPLY, root)[0] == 0
    assert sha256(read(os.path.join(root, TARGET))) == TABLE_ROWS[NEW].fixed_sha256


def test_an_adaptation_is_proven_on_the_poll_read(make_tree, tmp_path):
    # Without a diff for NEW, the nearest diff can be placed by its lines, but the loop
    # test reads each step as the engine does (poll() first): a failure on a rank the
    # step waits for ends with 'cancelled', not the worker's error. Apply refuses it, and
    # the gate, which proves an adapted fix it reads, says drift for one placed by hand.
    old_apply = bundle_without_the_new_diff(tmp_path / "bundle")
    root = make_tree(NEW)
    code, report = run(old_apply, root)
    assert (code, report["state"]) == (2, "drifted"), report
    assert "test_a_failed_step_ends_with_the_workers_error" in report["message"], report
    assert read(os.path.join(root, TARGET)) == release_bytes(NEW), "nothing written"
    [older] = [fix for fix in bundle.read_bundle() if fix.name == TABLE_ROWS["0.33.0"].diff]
    write(os.path.join(root, TARGET), rewrite(split_lines(release_bytes(NEW).decode()), narrowed(older)[0]).encode())
    code, report = run(old_apply, root, "--check")
    assert (code, report["state"]) == (2, "drifted"), report
    assert "stands, adapted" in report["message"], report


def test_a_read_no_proof_drives_is_drift(make_tree):
    # A later vLLM whose future grows another read: no diff, exact or adapted, is proven
    # on it, so the gate says drift with that reason, and nothing is written.
    root = make_tree(NEW)
    assert run(APPLY, root)[0] == 0
    marker = b"    def wait_briefly(self, pending: Sized, deadline: float) -> None:\n"
    fixed = read(os.path.join(root, TARGET))
    assert fixed.count(marker) == 1
    later = fixed.replace(marker, b"    def poll_nowait(self) -> bool:\n        return self.done()\n\n" + marker)
    write(os.path.join(root, TARGET), later)
    for args in (("--check",), (), ("--revert",)):
        code, report = run(APPLY, root, *args)
        assert (code, report["state"]) == (2, "drifted"), (args, report)
        assert "FutureWrapper.poll_nowait()" in report["message"], report
        assert read(os.path.join(root, TARGET)) == later, "nothing written"


def test_a_release_newer_than_the_table_is_named_and_proven(tmp_path):
    # A vLLM the table does not reach yet, as pip installs it (its dist-info beside
    # vllm/), whose worker loop differs from NEW's in one line: the nearest diff is placed
    # by its own lines. The gate names that release as newer than the table, and
    # says the fix is proven: by apply before it writes, by itself once it stands.
    root = tmp_path / "site-packages"
    put_release_files(str(root), NEW)  # its launcher and server file: NEW's
    data = release_bytes(NEW).replace(b"output = func(*args, **kwargs)", b"output = func(*args, **dict(kwargs))", 1)
    assert data != release_bytes(NEW)
    write(str(root / TARGET), data)
    info = root / "vllm-9.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.1.0\n")
    (info / "RECORD").write_text(f"{TARGET},sha256=x,{len(data)}\n")
    newer = f"vllm 9.1.0, newer than this bundle's table (to {list(TABLE_ROWS)[-1]})"
    code, report = run(APPLY, str(root), "--check")
    assert (code, report["adapted"]) == (1, True) and newer in report["message"], report
    assert "apply.py proves it with the loop test before it writes" in report["message"], report
    assert run(APPLY, str(root))[0] == 0
    code, report = run(APPLY, str(root), "--check")
    assert code == 0 and newer in report["message"] and "proven by the loop test" in report["message"], report


# Vendor edits of NEW outside the functions its diff carries, where that diff still fits
# by its functions (a hostile review's findings): each reads otherwise than the release,
# so the fit proves nothing until the loop test has run on it.
def future_fails_with_cancelled(data: bytes) -> bytes:
    return data.replace(b"self.set_exception(e)", b'self.set_exception(RuntimeError("cancelled"))', 1)


def handle_field_renamed(data: bytes) -> bytes:
    return data.replace(b"peer_worker_response_mqs", b"peer_response_mqs")


def read_bound_outside_the_class(data: bytes) -> bytes:
    return data + b"\n\ndef _peek(self):\n    return self.futures_queue[-1].get_response()\n\n\nFutureWrapper.peek = _peek\n"


def read_bound_in_the_class_body(data: bytes) -> bytes:
    marker = b"    def poll(self) -> bool:\n"
    return data.replace(marker, b"    peek = lambda self: self.futures_queue[-1].get_response()\n\n" + marker, 1)


def executor_reads_otherwise(data: bytes) -> bytes:
    marker = b"    def check_health(self) -> None:\n"
    return data.replace(marker, b"    def read_step_output_nowait(self):\n        return self.response_mqs[0].dequeue(timeout=0)\n\n"
                        + marker, 1)


VENDOR_EDITS = {
    "future-fails-with-cancelled": (future_fails_with_cancelled, "the loop test fails on the result"),
    "handle-field-renamed": (handle_field_renamed, "test_the_watch_of_other_nodes_reads_fields_the_worker_handle_has"),
    "read-bound-outside-the-class": (read_bound_outside_the_class, "FutureWrapper.peek()"),
    "read-bound-in-the-class-body": (read_bound_in_the_class_body, "FutureWrapper.peek()"),
    "executor-reads-otherwise": (executor_reads_otherwise, "MultiprocExecutor.read_step_output_nowait()"),
}


@pytest.mark.parametrize("case", sorted(VENDOR_EDITS))
def test_a_fit_by_the_diff_s_functions_is_proven_on_the_rest(case, make_tree):
    edit, reason = VENDOR_EDITS[case]
    root = make_tree(NEW)
    data = edit(release_bytes(NEW))
    assert data != release_bytes(NEW), "the edit took"
    write(os.path.join(root, TARGET), data)
    assert run(APPLY, root, "--check")[0] != 0
    code, report = run(APPLY, root)
    assert (code, report["state"]) == (2, "drifted") and reason in report["message"], report
    assert read(os.path.join(root, TARGET)) == data, "nothing written"
    if case != "future-fails-with-cancelled":
        return  # the same paths as below, each a proof of its own (CI's time)
    # The same file fixed by hand (the diff placed), with a write's left-over temporary
    # file beside it: neither the gate nor apply nor --diff says 0 for it.
    decision, adaptation = decide_any(data.decode(), bundle.read_bundle(), exact=False)
    assert decision.fix.name == TABLE_ROWS[NEW].diff, decision
    fixed = rewrite(split_lines(data.decode()), (adaptation or decision).fix).encode()
    write(os.path.join(root, TARGET), fixed)
    open(os.path.join(root, os.path.dirname(TARGET), ".rank-exception-fatal-left.tmp"), "w").close()
    for args in (("--check",), (), ("--diff",)):
        code, report = run(APPLY, root, *args)
        assert (code, report["state"]) == (2, "drifted") and reason in report["message"], (args, report)


def test_a_file_nested_past_the_parser_is_drift_in_one_line(make_tree):
    root = make_tree(NEW)
    data = release_bytes(NEW) + b"\n_vendor = a" + b".b" * 100000 + b"\n"
    write(os.path.join(root, TARGET), data)
    for args in (("--check",), ()):
        done = subprocess.run([sys.executable, APPLY, "--root", root, *args], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot be read as Python" in done.stderr, done
    assert read(os.path.join(root, TARGET)) == data
