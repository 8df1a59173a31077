"""Recognition: a drifted file is never written, a build between releases is fixed by the diffs'
own lines and proven by the loop test, a file no diff fits is judged by what its loop does,
and none whose loop drops a failure reads 0."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import apply
import fetch_release
from rank_exception_fatal import bundle, bytecode, match
from conftest import TARGET, release_bytes
from helpers import INPUTS, UNCHECKED, change_a_loop_line, leftovers, patched_bytes, read, run_loop_test, target, write

pytestmark = pytest.mark.usefixtures("no_environment_root")  # the tree each test names, not scripts/test's


def half_applied(data: bytes) -> bytes:
    fix = next(f for f in bundle.read_bundle() if f.name == "v0.33.0.diff")
    lines = match.split_lines(data.decode())
    return match.rewrite(lines, bundle.Fix(fix.name, fix.hunks[:1])).encode()


LOOP_LINE = b'            logger.exception("WorkerProc hit an exception.")\n'


def loop_hunk(version: str) -> tuple[int, bundle.Hunk]:
    """The number and hunk of the release's diff that holds the worker loop's exception log."""
    lines = match.split_lines(release_bytes(version).decode())
    fix = next(f for f in bundle.read_bundle() if match.fingerprint(lines, f))
    return next((n, h) for n, h in enumerate(fix.hunks, 1) if LOOP_LINE.decode() in h.before)


def with_a_copy(side: str):
    """The file with a copy of the loop function's release or fixed text in another class."""
    return lambda data: data + b"\n\nclass Copy:\n" + "".join(getattr(loop_hunk("0.30.0")[1], side)).encode()


def fixed_in_place(data: bytes) -> bytes:
    _, hunk = loop_hunk("0.30.0")
    return data.replace("".join(hunk.before).encode(), "".join(hunk.after).encode())


def both_stand() -> list[str]:
    return [f"v0.30.0.diff hunk {loop_hunk('0.30.0')[0]}: its release text (line ", "both stand; only one may"]


# case: (release, what becomes of its file, what the message says: a string, or a function giving strings)
# A vendor's wrapper: the release's method, called from another bound in its place.
VENDOR_WRAPPER = b"""

_release_execute_worker_rpc = WorkerProc._execute_worker_rpc


def _vendor_execute_worker_rpc(self, *args, **kwargs):
    return _release_execute_worker_rpc(self, *args, **kwargs)


WorkerProc._execute_worker_rpc = _vendor_execute_worker_rpc
"""


SETATTR = b'\nsetattr(WorkerProc, "_execute_worker_rpc", print)\n'
CLASS_REBOUND = b"\n\nclass VendorProc(WorkerProc):\n    pass\n\n\nWorkerProc = VendorProc\n"


def line_after_release(appended: bytes, line: str) -> int:
    """The number of a line of appended, once appended to the 0.30.0 release file."""
    return (release_bytes("0.30.0") + appended).decode().splitlines().index(line) + 1


DRIFTS = {
    "changed-loop-line": ("0.30.0", change_a_loop_line, "found:    '            logger.exception(\"Worker failed.\")\\n'"),
    # Whitespace is what differs here, and what the message must show.
    "trailing-space": ("0.30.0", lambda d: d.replace(LOOP_LINE, LOOP_LINE[:-1] + b"  \n"),
                       "line 1055:\n    expected: '            logger.exception(\"WorkerProc hit an exception.\")\\n'\n"
                       "    found:    '            logger.exception(\"WorkerProc hit an exception.\")  \\n'"),
    # One line more in the loop: the guess names the diff of this release's shape, at that line.
    "line-added": ("0.30.0", lambda d: d.replace(b"            output = func(*args, **kwargs)\n",
                                                 b"            output = func(*args, **kwargs)\n            print(output)\n"),
                   lambda: [f"closest: v0.30.0.diff hunk {loop_hunk('0.30.0')[0]} (release text), line 1048:\n"
                            "    expected: (no line here)\n    found:    '            print(output)\\n'"]),
    # One blank line fewer: the lines on either side of the gap may be alike, so the gap is named.
    "blank-line-removed": ("0.30.0", lambda d: d.replace(b"            output = func(*args, **kwargs)\n\n",
                                                         b"            output = func(*args, **kwargs)\n"),
                           lambda: [f"closest: v0.30.0.diff hunk {loop_hunk('0.30.0')[0]} (release text), line 1048:\n"
                                    "    expected: '\\n'\n    found:    (missing)"]),
    "nul-bytes": ("0.30.0", lambda d: d + b"\0\0\0", "the file holds NUL bytes"),
    # A copy of the function elsewhere: which one runs is a guess, and a rewrite would leave the other.
    "release-and-fixed-text": ("0.30.0", with_a_copy("after"), both_stand),
    "fixed-and-release-text": ("0.30.0", lambda d: with_a_copy("before")(fixed_in_place(d)), both_stand),
    "crlf": ("0.26.0", lambda d: d.replace(b"\n", b"\r\n"), "CRLF line endings"),
    "empty": ("0.26.0", lambda d: b"", "the file is empty"),
    "not-utf8": ("0.30.0", lambda d: d.replace(b"WorkerProc hit", b"WorkerProc \xff hit"), "not UTF-8"),
    "half-applied": ("0.33.0", half_applied, "half-applied: v0.33.0.diff hunk 1 is in place"),
    # The changed functions stand as released, but the module binds another in their place.
    "method-rebound-at-the-end": ("0.30.0", lambda d: d + VENDOR_WRAPPER, lambda: [
        f"v0.30.0.diff fits, but line {line_after_release(VENDOR_WRAPPER, VENDOR_WRAPPER.decode().splitlines()[-1])}"
        " rebinds WorkerProc._execute_worker_rpc"]),
    "method-set-by-setattr": ("0.30.0", lambda d: d + SETATTR, lambda: [
        f"line {line_after_release(SETATTR, SETATTR.decode().strip())} rebinds WorkerProc._execute_worker_rpc"]),
    "class-rebound": ("0.30.0", lambda d: d + CLASS_REBOUND, lambda: [
        f"line {line_after_release(CLASS_REBOUND, 'WorkerProc = VendorProc')} rebinds WorkerProc:"]),
    "method-defined-twice": ("0.30.0", lambda d: d.replace(b"    READY_STR = ",
                                                           b"    def _execute_worker_rpc(self, *a):\n        pass\n\n"
                                                           b"    READY_STR = ", 1),
                             lambda: ["defines WorkerProc._execute_worker_rpc again (first at line "]),
}


# Drift only under --exact: the diff's own lines still stand, and are placed (see below).
PLACEABLE = {"line-added", "blank-line-removed"}


@pytest.mark.parametrize("case", sorted(DRIFTS))
def test_drifted_source_is_never_written(case, make_tree, capsys):
    version, mangle, reason = DRIFTS[case]
    reasons = reason() if callable(reason) else [reason]
    root = make_tree(version)
    path = target(root)
    write(path, mangle(release_bytes(version)))
    drifted = read(path)
    exact = ["--exact"] if case in PLACEABLE else []
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *exact, *mode]) == 2, mode
        assert read(path) == drifted
        message = capsys.readouterr().err
        assert path in message and all(reason in message for reason in reasons), message
        expected = re.findall(r"^    expected: (.*)$", message, re.M)
        found = re.findall(r"^    found:    (.*)$", message, re.M)
        assert expected != found or not expected, f"a difference that prints as none: {message}"
        assert "tried: " + ", ".join(fix.name for fix in bundle.read_bundle()) in message
        assert hashlib.sha256(drifted).hexdigest() in message
    assert leftovers(root) == []


# --- builds between releases ---------------------------------------------------------
# What upstream changes between releases inside a function a diff carries whole, made
# from the release files (fetched as every test fetches them) by a small edit each.

def docstring_changed(data: bytes) -> bytes:
    return re.sub(rb'"""Main busy loop for Multiprocessing Workers\.?"""', b'"""The RPC loop of a worker."""', data, count=1)


def argument_added(data: bytes) -> bytes:
    return data.replace(b"output = func(*args, **kwargs)", b"output = func(*args, **dict(kwargs))", 1)


def line_added_in_the_monitor(data: bytes) -> bytes:
    return re.sub(rb"(\n        def monitor_workers\(\):\n)", rb"\1            checked = 0  # a local of a later build\n", data,
                  count=1)


def local_renamed(data: bytes) -> bytes:
    return re.sub(rb"\bsentinels\b", b"worker_sentinels", data)


def except_branch_changed(data: bytes) -> bytes:
    return data.replace(b'logger.exception("WorkerProc hit an exception.")',
                        b'logger.exception("WorkerProc hit an exception.", stack_info=True)', 1)


def only_rank_0_runs_calls(data: bytes) -> bytes:
    """A build whose RPC function lets only rank 0 run a call: the diff's own lines still
    stand, but no other rank can fail, let alone exit; the proof must refuse it."""
    return data.replace(b"            output = func(*args, **kwargs)\n",
                        b"            if self.rank != 0:\n                return\n            output = func(*args, **kwargs)\n", 1)


# case: (release, edit), across the loop shapes of six diffs
BETWEEN_RELEASES = {
    "0.9.0-docstring": ("0.9.0", docstring_changed),
    "0.10.2-argument": ("0.10.2", argument_added),
    "0.13.0-line-in-monitor": ("0.13.0", line_added_in_the_monitor),
    "0.26.0-renamed-local": ("0.26.0", local_renamed),
    "0.30.0-line-added": ("0.30.0", DRIFTS["line-added"][1]),
    "0.33.0-argument": ("0.33.0", argument_added),
}
if os.environ.get("RANK_EXCEPTION_FATAL_RELEASES") == "named":
    # Under 3.10 and 3.13 (scripts/test): the shapes at either end. What varies with
    # Python is how apply.py reads the text, and each case runs the loop test twice.
    BETWEEN_RELEASES = {case: BETWEEN_RELEASES[case] for case in ("0.9.0-docstring", "0.33.0-argument")}


@pytest.mark.parametrize("case", sorted(BETWEEN_RELEASES))
def test_a_build_between_releases_is_fixed_by_the_diffs_own_lines(case, make_tree, capsys):
    version, edit = BETWEEN_RELEASES[case]
    root = make_tree(version)
    build = edit(release_bytes(version))
    assert build != release_bytes(version), "the edit took"
    write(target(root), build)
    assert apply.main(["--root", root, "--exact", "--check"]) == 2, "not a release's functions"
    capsys.readouterr()
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["diff"], report["adapted"]) == (f"v{version}.diff", True), report
    assert f"written for vllm {version}, whose changed functions differ here in " in report["message"]

    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapted"] and "; proven by the loop test" in report["message"], report
    assert apply.main(["--root", root, "--check"]) == 0
    assert apply.main(["--root", root]) == 0 and "already applied" in capsys.readouterr().out
    # The loop test, as an operator runs it, on what was written.
    done = run_loop_test(root)
    assert done.returncode == 0 and re.search(r"^OK$", done.stderr, re.M), done.stderr

    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(target(root)) == build, "the build's exact bytes back"


@pytest.mark.parametrize("version", ["0.10.2", "0.30.0"])
def test_a_changed_except_branch_is_never_placed(version, make_tree, capsys):
    """The fix rests on what the loop's except branch does: changed anywhere, it is drift."""
    root = make_tree(version)
    write(target(root), except_branch_changed(release_bytes(version)))
    for args in (["--check"], []):
        assert apply.main(["--root", root, *args]) == 2
    assert read(target(root)) == except_branch_changed(release_bytes(version))


def test_a_placed_change_that_the_loop_test_refuses_is_not_written(make_tree, capsys):
    root = make_tree("0.30.0")
    build = only_rank_0_runs_calls(release_bytes("0.30.0"))
    assert build != release_bytes("0.30.0")
    write(target(root), build)
    assert apply.main(["--root", root, "--check"]) == 1  # placeable; the proof comes with the write
    for args in ([], ["--diff"]):
        assert apply.main(["--root", root, *args]) == 2
        err = capsys.readouterr().err
        assert "could be adapted" in err and "the loop test fails on the result: " in err
        assert "test_failing_non_output_rank_exits" in err
    assert read(target(root)) == build and leftovers(root) == []


def test_drift_names_the_diff_nearest_to_the_files_shape(make_tree, capsys):
    """vllm-tpu 0.11.1's file (upstream main of 2025-10-12) with one annotation written as
    Optional[...], as main wrote them a week before: no diff fits, and the message names
    the one whose text stands here but for that line, not a diff of another shape that
    shares one function with the file."""
    build = next(b for b in fetch_release.read_builds() if b.diff == "main-8fcaaf6a.diff")
    root = make_tree("0.30.0")
    with open(os.path.join(fetch_release.build_tree(build), TARGET), "rb") as f:
        data = f.read()
    new = b"    def worker_busy_loop(self, cancel: threading.Event | None = None):\n"
    assert data.count(new) == 1
    write(target(root), data.replace(new, b"    def worker_busy_loop(self, cancel: Optional[threading.Event] = None):\n"))
    assert apply.main(["--root", root, "--check"]) == 2
    err = capsys.readouterr().err
    assert "  closest: main-8fcaaf6a.diff hunk " in err, err
    assert "    found:    '    def worker_busy_loop(self, cancel: Optional[threading.Event] = None):\\n'" in err, err


REPLY_IN_THE_LOOP = re.compile(
    rb'(logger\.exception\("WorkerProc hit an exception\."\)\n(?: *#.*\n)*)( +)'
    rb"if output_rank is None or self\.rank == output_rank:\n +self\.handle_output\(e\)\n"
)


def fails_fast_by_its_own_code(data: bytes) -> bytes:
    """A fix written otherwise than this bundle's (upstream's, a vendor's): a rank whose
    failure nobody reads exits."""
    return REPLY_IN_THE_LOOP.sub(
        rb"\1\2if output_rank is None or self.rank == output_rank:\n\2    self.handle_output(e)\n"
        rb"\2else:\n\2    os._exit(1)  # nobody reads this rank's failure\n", data, count=1)


def every_rank_replies(data: bytes) -> bytes:
    return REPLY_IN_THE_LOOP.sub(rb"\1\2self.handle_output(e)\n", data, count=1)


# The last release before 0.8.5: every rank replies its own failure (not in the table).
UNAFFECTED_RELEASE = ("0.8.4", "72ec532ccc9da77de4ca05c5b198cf88d3d53f21ce9199957d537fb33d1e96ca")

BEHAVIOURS = {
    "fixed-by-its-own-code-0.11.0": ("0.11.0", fails_fast_by_its_own_code, 0, "fails-fast"),
    "release-0.8.4": (None, None, 0, "not-affected"),
}
# From 0.11.1 the executor runs across nodes, where a rank that exits on a follower must
# end the engine through the executor's watch of other nodes, which the behaviour probe
# does not drive: a file that fails fast on one node by its own code is not proven there.
ACROSS_NODES = "its executor runs across nodes (peer_worker_response_mqs)"


@pytest.mark.parametrize("case", sorted(BEHAVIOURS))
def test_a_file_no_diff_fits_is_judged_by_what_its_loop_does(case, make_tree, tmp_path, capsys):
    """Already fixed otherwise (the exit path is still written), or never broken (nothing
    to write): the gate passes."""
    version, edit, code, state = BEHAVIOURS[case]
    if version is None:
        root = str(tmp_path / "tree")
        shutil.copytree(fetch_release.unlisted_release_tree(*UNAFFECTED_RELEASE), root)
        data = read(target(root))
    else:
        root = make_tree(version)
        data = edit(release_bytes(version))
        assert data != release_bytes(version), "the edit took"
        write(target(root), data)
    if state == "fails-fast":  # the engine still ends, and vllm serve must then exit non-zero
        assert apply.main(["--root", root, "--check", "--json"]) == 1, "the exit path is still to apply"
        report = json.loads(capsys.readouterr().out)
        assert (report["files"][0]["state"], report["diff"]) == (state, None), report
        assert apply.main(["--root", root, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["action"], report["diff"]) == (state, "applied", None), report
    for args in (["--check"], []):  # without the bug, nothing fires: the exit path is not asked for
        assert apply.main(["--root", root, *args, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["action"], report["diff"]) == (state, "none", None), report
        assert read(target(root)) == data, "the executor is left as it is"
    assert apply.main(["--root", root, "--revert"]) == 2, "not this bundle's to revert"
    assert apply.main(["--root", root, "--exact", "--check"]) == 2, "--exact: a release's functions only"


@pytest.mark.parametrize("version", ["0.26.0", "0.30.0"])
def test_a_local_fail_fast_across_nodes_is_not_judged(version, make_tree, capsys):
    """A vendor's fail-fast of a release that runs across nodes: the non-output branch
    exits, and nothing else. Its loop fails fast on one node, but a follower's rank that
    fails and exits is never noticed by the engine's executor, which waits out the RPC
    timeout with /health 200: the bug. Drift, with that reason, and nothing written."""
    root = make_tree(version)
    data = fails_fast_by_its_own_code(release_bytes(version))
    assert data != release_bytes(version), "the edit took"
    write(target(root), data)
    for args in (["--check"], []):
        assert apply.main(["--root", root, *args, "--json"]) == 2, args
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted" and ACROSS_NODES in report["message"], report
        assert "its loop reads fails-fast on one node" in report["message"], report
        assert read(target(root)) == data


# --- false greens: a judged, adapted or fitting file that must not read 0 (issue 21) -----------

def exits_where(condition: bytes):
    """A vendor's fix: the output rank replies its failure, another rank exits only
    where condition holds."""
    return lambda data: REPLY_IN_THE_LOOP.sub(
        rb"\1\2if output_rank is None or self.rank == output_rank:\n\2    self.handle_output(e)\n"
        rb"\2elif " + condition + rb":\n\2    os._exit(1)\n", data, count=1)


def switch_set_in_init(data: bytes) -> bytes:
    """A vendor's opt-in: on by the class default, off by __init__ unless an environment
    variable says so; only the class default reads as failing fast."""
    data = exits_where(b"self.vendor_fail_fast")(data)
    data = data.replace(b'    READY_STR = "READY"\n', b'    READY_STR = "READY"\n    vendor_fail_fast = True\n', 1)
    return data.replace(b"        self.rank = rank\n", b'        self.rank = rank\n'
                        b'        self.vendor_fail_fast = os.environ.get("VENDOR_FAIL_FAST") == "1"\n', 1)


def release_method(version: str, name: str) -> bytes:
    """A WorkerProc method of a release, as a module-level function of the same text."""
    text = release_bytes(version).decode()
    start = text.index(f"    def {name}(")
    end = re.compile(r"\n    (?:@|def )").search(text, start + 1).start()
    return "".join(line[4:] if line.strip() else line for line in text[start:end].splitlines(True)).encode()


def method_rebound_to_the_release_copy(data: bytes) -> bytes:
    """A file that fails fast in its class, whose module then binds the release's own
    method in its place (the copy is what runs)."""
    copy = release_method("0.30.0", "_execute_worker_rpc").replace(b"def _execute_worker_rpc(", b"def _vendor_rpc(", 1)
    return fails_fast_by_its_own_code(data) + b"\n\n" + copy + b"\n\nWorkerProc._execute_worker_rpc = _vendor_rpc\n"


def extra_except_clause(data: bytes) -> bytes:
    """A vendor's clause above the release's branch: a KeyError never reaches the branch
    the fix goes into, and a non-output rank that fails with one goes on."""
    return data.replace(
        b"                self.handle_output(output)\n        except Exception as e:\n",
        b"                self.handle_output(output)\n        except KeyError as e:\n"
        b'            logger.warning("unknown request: %s", e)\n        except Exception as e:\n', 1)


def inline_loop_kept(data: bytes) -> bytes:
    """A 0.30.0 file whose vendor kept the inline loop of 0.26.0: the loop that runs
    never calls _execute_worker_rpc, where the 0.30.0 diff puts the fix."""
    loop = re.compile(rb"    def worker_busy_loop\(self\):\n.*?\n(?=    def _execute_worker_rpc\()", re.S)
    old_loop = b"    " + release_method("0.26.0", "worker_busy_loop").replace(b"\n", b"\n    ").rstrip(b" ") + b"\n"
    return loop.sub(lambda m: old_loop, data, count=1)


def loop_assigned_at_the_end(data: bytes) -> bytes:
    loop = release_method("0.26.0", "worker_busy_loop").replace(b"def worker_busy_loop(", b"def _vendor_loop(", 1)
    return data + b"\n\n" + loop + b"\n\nWorkerProc.worker_busy_loop = _vendor_loop\n"


# finding: (release, edit); each read 0 before (judged, adapted or fitting), none may now.
FALSE_GREENS = {
    "1-every-rank-replies-to-an-unread-call": ("0.33.0", every_rank_replies),
    "2-exits-only-where-the-output-rank-is-not-0": ("0.30.0", exits_where(b"output_rank")),
    "3-exits-only-on-execute_model": ("0.30.0", exits_where(b'method == "execute_model"')),
    "3-exits-only-on-execute_model-0.26.0": ("0.26.0", exits_where(b'method == "execute_model"')),
    "4-switch-that-init-turns-off": ("0.30.0", switch_set_in_init),
    "5-method-rebound-to-the-release-copy": ("0.30.0", method_rebound_to_the_release_copy),
    "7-inline-loop-kept": ("0.30.0", inline_loop_kept),
    "7-loop-assigned-at-the-end": ("0.30.0", loop_assigned_at_the_end),
    "16-extra-except-clause": ("0.30.0", extra_except_clause),
}


@pytest.mark.parametrize("case", sorted(FALSE_GREENS))
def test_a_file_whose_running_loop_drops_a_failure_never_reads_0(case, make_tree, capsys):
    version, edit = FALSE_GREENS[case]
    root = make_tree(version)
    data = edit(release_bytes(version))
    assert data != release_bytes(version), "the edit took"
    compile(data, "edited", "exec")
    write(target(root), data)
    for args in (["--check"], [], ["--check"]):
        assert apply.main(["--root", root, *args, "--json"]) == 2, (case, args)
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted", report
        assert read(target(root)) == data, "nothing written"


def test_a_judged_file_with_stale_bytecode_of_the_release(make_tree, capsys):
    """A fails-fast source beside an unchecked-hash .pyc of the release: the .pyc is what
    Python runs, so --check says 1 and apply removes it."""
    root = make_tree("0.11.0")
    path = target(root)
    subprocess.run([sys.executable, "-c", UNCHECKED, path], check=True)
    [pyc] = bytecode.bytecode_files([path], None)
    write(path, fails_fast_by_its_own_code(release_bytes("0.11.0")))
    assert apply.main(["--root", root, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["message"].startswith(f"stale bytecode {pyc} would run instead of this file"), report
    assert os.path.exists(pyc), "--check writes nothing"
    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "fails-fast" and "removed stale bytecode" in report["message"], report
    assert not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


def test_the_loop_test_refuses_a_switch_init_sets(make_tree, tmp_path):
    """The bundle's own loop test runs the class as __init__ leaves it: a fixed file whose
    __init__ then sets the exit switch from an environment variable fails it."""
    root = make_tree("0.30.0")
    fixed = patched_bytes("0.30.0", tmp_path)
    statement = b"            not vllm_config.parallel_config.enable_fault_tolerance\n        )\n"
    assert fixed.count(statement) == 1
    write(target(root), fixed.replace(statement, statement + b'        self.exit_on_unreported_failure = '
                                      b'os.environ.get("VENDOR_EXIT") == "1"\n'))
    done = run_loop_test(root, "test_rank_exception_fatal.WorkerLoopTest")
    assert done.returncode != 0 and "UnknownSwitch: line " in done.stderr, done.stderr[-2000:]
    write(target(root), fixed)
    done = run_loop_test(root, "test_rank_exception_fatal.WorkerLoopTest")
    assert done.returncode == 0, done.stderr[-2000:]


# Upstream's own fail-fast fix (vllm-project/vllm 79816ab04b1a: FAIL_FAST_RPCS, every rank
# exits on a fatal call, the output rank once it has replied): the release file of 0.32.0,
# which that commit's file is built on, plus that commit's change, kept as a test input.
UPSTREAM_FIX = ("0.32.0", os.path.join(INPUTS, "vllm-79816ab.diff"),
                "54d67e390340a23f425a2c8532c3c6d6501b873c5fa64bdd97083a262da9feab")


def upstream_fix_bytes(tmp_path) -> bytes:
    version, diff, digest = UPSTREAM_FIX
    work = tmp_path / "upstream"
    (work / TARGET).parent.mkdir(parents=True)
    write(str(work / TARGET), release_bytes(version))
    subprocess.run(["git", "apply", diff], cwd=work, check=True)
    data = read(str(work / TARGET))
    assert hashlib.sha256(data).hexdigest() == digest, "the file of upstream's commit, byte for byte"
    return data


def test_upstreams_own_fix_is_not_proven_across_nodes(make_tree, tmp_path, capsys):
    # Its ranks exit on one node, but its executor does not watch the workers of other
    # nodes (a follower's exit leaves the engine to the RPC timeout): not proven, drift.
    data = upstream_fix_bytes(tmp_path)
    root = make_tree("0.32.0")
    write(target(root), data)
    for args in (["--check"], [], ["--check"]):
        assert apply.main(["--root", root, *args, "--json"]) == 2, args
        report = json.loads(capsys.readouterr().out)
        assert report["state"] == "drifted" and ACROSS_NODES in report["message"], report
        assert read(target(root)) == data
