"""The executor's cause note (docs/supervisor.md §2), on every executor diff's own file.

When the fix ends the engine, the fixed executor tells the API server why, so that the
API server's last line names the rank, the call and the error, and a stop that arrives
before the API server has heard of the death still exits 1. It writes a note through the
exit path's helper module (the real one, as patches/helper/helper.diff creates it) into
the directory that the API server exports as RANK_EXCEPTION_FATAL_NOTES:

- a rank that exits because its failure would be dropped, or because every rank answers
  the call: "rank-failed", its rank, the call, the exception, status 1;
- the worker monitor, for a worker that died otherwise: "worker-died", its rank and status,
  unless it ended as asked to stop (a supervisor signals the whole group), and never with
  fault tolerance on;
- the watch of the workers on other nodes: "rank-disconnected", the lost rank.

The rank and the monitor run in a child as the loop test runs them (the loop probe); the
watch runs here, on stand-in zmq sockets. Without the variable nothing is written, and a
missing helper never holds a rank's exit.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import types
import unittest.mock

import pytest

from helpers import made_from
from rank_exception_fatal import bundle
from rank_exception_fatal.loop_probe.cases import run_case
from rank_exception_fatal.loop_probe.extract import extract_worker_monitor, release_has_fault_tolerance
from rank_exception_fatal.outcome import TARGET
from test_rank_exception_fatal import (RemoteResponseQueue, StandInExecutor, TimedResponseQueue, fake_zmq,
                                       runs_on_several_nodes)

import apply

DIFFS = sorted(name for name in os.listdir(bundle.PATCHES_DIR) if name.endswith(".diff"))
# The shapes before a rank other than 0 replied a call every rank answers and then exited
# (0.11.1, and upstream main just before it), and those without the watch of other nodes.
NO_REPLY_THEN_EXIT = {"v0.8.5.diff", "v0.9.0.diff", "v0.10.2.diff", "v0.11.0.diff"}
ONE_NODE = NO_REPLY_THEN_EXIT | {diff for diff in DIFFS if diff.startswith("main-")}
NOTE = "cause.json"
STEP = [{"method": "execute_model", "output_rank": 0}, {"method": "sample_tokens", "output_rank": 0}]


@pytest.fixture(scope="module", params=DIFFS)
def fixed(request, tmp_path_factory) -> str:
    """The file each diff was made from, fixed by apply.py."""
    root = str(tmp_path_factory.mktemp(request.param))
    os.makedirs(os.path.dirname(os.path.join(root, TARGET)))
    shutil.copyfile(os.path.join(made_from(request.param), TARGET), os.path.join(root, TARGET))
    assert apply.main(["--root", root, "--exact", "--executor-only"]) == 0  # the executor's note alone
    return os.path.join(root, TARGET)


def notes_for(tmp_path, helper_root: str | None) -> tuple[str, dict]:
    """(a fresh notes directory, the environment of a process the API server started)."""
    notes = tmp_path / f"notes{len(os.listdir(tmp_path))}"
    notes.mkdir(mode=0o700)
    notes = str(notes)
    env = {**os.environ, "RANK_EXCEPTION_FATAL_NOTES": notes}
    env.pop("PYTHONPATH", None)
    if helper_root:
        env["PYTHONPATH"] = helper_root
    return notes, env


def the_note(notes: str) -> dict | None:
    try:
        with open(os.path.join(notes, NOTE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def fields(note: dict | None, *names: str) -> dict | None:
    return None if note is None else {name: note.get(name) for name in names}


RANK_FAILED = ("cause", "rank", "call", "exception_type", "exception_message", "worker_exit_status")


def test_a_rank_that_exits_names_itself_its_call_and_its_error(fixed, helper_root, tmp_path):
    notes, env = notes_for(tmp_path, helper_root)
    outcome = run_case(fixed, 2, STEP, env=env)
    assert outcome.returncode == 1, outcome
    note = the_note(notes)
    assert fields(note, *RANK_FAILED) == {
        "cause": "rank-failed", "rank": 2, "call": "execute_model", "exception_type": "RuntimeError",
        "exception_message": "device out of memory during prefill", "worker_exit_status": 1}, outcome
    assert note["host"] == socket.gethostname() and note["pid"] != os.getpid(), note


def test_a_rank_that_replies_then_exits_names_itself(fixed, helper_root, tmp_path, request):
    # A model step every rank answers (a KV or EC connector): rank 3 replies its failure,
    # then exits.
    if request.node.callspec.params["fixed"] in NO_REPLY_THEN_EXIT:
        return
    notes, env = notes_for(tmp_path, helper_root)
    calls = [{"method": "execute_model", "output_rank": None}, {"method": "sample_tokens", "output_rank": None}]
    outcome = run_case(fixed, 3, calls, env=env)
    assert outcome.returncode == 1, outcome
    assert fields(the_note(notes), *RANK_FAILED) == {
        "cause": "rank-failed", "rank": 3, "call": "execute_model", "exception_type": "RuntimeError",
        "exception_message": "device out of memory during prefill", "worker_exit_status": 1}, outcome


def test_a_failure_the_rank_replies_and_serves_on_writes_nothing(fixed, helper_root, tmp_path):
    # The output rank's failure goes back to the caller, which may serve on: not a death.
    notes, env = notes_for(tmp_path, helper_root)
    outcome = run_case(fixed, 0, STEP, env=env)
    assert outcome.returncode == 0 and outcome.replies, outcome
    assert the_note(notes) is None and os.listdir(notes) == [], os.listdir(notes)


# How the monitor's worker ends -> the note's worker_exit_status (None: no note). A worker
# that exited 0 or ended on SIGTERM or SIGINT ended as a stop of the whole group ends it.
WORKER_ENDS = {"SIGKILL": -9, "SIGTERM": None, "SIGINT": None, "0": None}


def test_the_monitor_names_a_dead_worker_but_not_a_stopped_one(fixed, helper_root, tmp_path):
    cases = [(ends, status, False) for ends, status in WORKER_ENDS.items()]
    if release_has_fault_tolerance(fixed):
        cases.append(("SIGKILL", None, True))  # the engine handles a dead worker itself: no note
    for worker_ends, status, fault_tolerance in cases:
        notes, env = notes_for(tmp_path, helper_root)
        outcome = run_case(fixed, monitor=True, fault_tolerance=fault_tolerance, worker_ends=worker_ends, env=env)
        assert outcome.returncode == 0 and not outcome.timed_out, outcome
        assert [e for e in outcome.events if "called_back" in e] == [{"called_back": True, "is_failed": True}], outcome
        note = fields(the_note(notes), "cause", "rank", "worker_exit_status", "call", "exception_type")
        expected = None if status is None else {"cause": "worker-died", "rank": 1, "worker_exit_status": status,
                                                "call": None, "exception_type": None}
        assert note == expected, (worker_ends, fault_tolerance, outcome)


def test_without_the_directory_or_the_helper_a_rank_exits_as_ever(fixed, helper_root, tmp_path):
    # The release's API server exports no directory; an executor fixed alone has no helper
    # module to write with: either way the rank's exit is the fix's, unchanged.
    for with_directory, helper in ((False, helper_root), (True, None)):
        _, env = notes_for(tmp_path, helper)
        if not with_directory:
            del env["RANK_EXCEPTION_FATAL_NOTES"]
        outcome = run_case(fixed, 1, STEP, env=env)
        assert outcome.returncode == 1 and outcome.escaped == [] and outcome.replies == [], outcome
        assert len(outcome.error_lines()) == 1, outcome


def test_a_lost_node_is_named_by_the_watch(fixed, helper_root, tmp_path, monkeypatch, request):
    # Multi-node (0.11.1 on): the executor sees rank 1 on another node only as its
    # connection drops, and names it.
    if request.node.callspec.params["fixed"] in ONE_NODE:
        assert not runs_on_several_nodes(fixed)
        return
    watch = extract_worker_monitor(fixed)["_watch_remote_workers"]
    notes, _ = notes_for(tmp_path, helper_root)
    monkeypatch.setenv("RANK_EXCEPTION_FATAL_NOTES", notes)
    monkeypatch.syspath_prepend(helper_root)
    remote, called_back = RemoteResponseQueue(), threading.Event()
    executor = StandInExecutor(
        workers=(types.SimpleNamespace(worker_response_mq=TimedResponseQueue(), peer_worker_response_mqs=[None, remote],
                                       proc=types.SimpleNamespace(kill=lambda: None)),),
        parallel_config=types.SimpleNamespace(enable_fault_tolerance=False),
        is_failed=False, shutting_down=False, failure_callback=called_back.set, shutdown=lambda: None)
    with unittest.mock.patch.dict(sys.modules, fake_zmq()):  # restores sys.modules as it was
        for name in [name for name in sys.modules if name.split(".")[0] == "vllm"]:
            del sys.modules[name]  # the helper comes from helper_root, as on a node
        watch(executor)
        remote.connection.drop()
        assert called_back.wait(10), "the watch did not end the engine"
    # Its host is the lost rank's, which the watch does not know: not this one's.
    assert fields(the_note(notes), "cause", "rank", "call", "host") == {
        "cause": "rank-disconnected", "rank": 1, "call": None, "host": None}


def test_apply_keeps_the_directory_from_its_proofs(monkeypatch, tmp_path, capsys):
    # apply.py's proofs run the fix's code in its children: started from a process that a
    # patched API server started, they must not write into that server's directory.
    monkeypatch.setenv("RANK_EXCEPTION_FATAL_NOTES", str(tmp_path))
    assert apply.main(["--help"]) == 0
    assert "RANK_EXCEPTION_FATAL_NOTES" not in os.environ
