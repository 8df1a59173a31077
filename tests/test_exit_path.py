"""The API server's exit path (issue 35, docs/supervisor.md): its diffs on every release's
real files, and the helper module's exit status and last lines.

Applied by apply.py with the executor's diff (tests/test_exit_path_files.py). Here: releases/exit_path.tsv is whole and names every diff
of patches/launcher/ and patches/server/; on each release's launcher and server file
(from its wheel), the diff the table names passes git apply and patch -F0, gives the
fixed sha256, puts each hook first in its function (run_server's exit call last) and
reverts byte-exact, and is what scripts/make_exit_diffs.py writes; patches/helper/
helper.diff creates a module that compiles and imports with the standard library alone.
Then the module, driven in a child process as run_server, the launcher and the signal
handler call it (exit_path_child.py), with cause notes written by other processes:
status 1 and the two last lines when the engine died before a stop, 0 and nothing
after a stop asked for while the engine was alive.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import TESTS
import fetch_release
from fetch_release import RELEASES, exit_path_tree, exit_paths
from make_diff import creation_diff, make_diff
from make_exit_diffs import HELPER_DIFF, HELPER_PATH, hooked, shape
from rank_exception_fatal import bundle
from rank_exception_fatal.hooks import hooks_out_of_place
from rank_exception_fatal.table import ROLES, read_exit_paths

CASES = [(version, role) for version in RELEASES for role in ROLES]
# The JSON event's keys (schema 1), as docs/supervisor.md documents them.
EVENT_KEYS = {"event", "schema", "role", "cause", "rank", "node", "host", "call", "exception_type",
              "exception_message", "worker_exit_status", "exit_status", "vllm_version", "pid", "time", "source"}


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run(root: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=root, capture_output=True, text=True)


def test_the_table_names_every_diff_and_every_release():
    named = {role: {exit_paths()[version].role(role)[0] for version in RELEASES} for role in ROLES}
    for role in ROLES:
        on_disk = {f"{role}/{name}" for name in os.listdir(os.path.join(bundle.PATCHES_DIR, role))}
        assert on_disk == named[role]
        for diff in on_disk:
            # Named after the oldest release it serves, as the executor's are.
            oldest = next(v for v in RELEASES if exit_paths()[v].role(role)[0] == diff)
            assert diff == f"{role}/v{oldest}.diff"
            # The path the table gives the diff's releases (where the gate looks) is the one the diff writes.
            target = read(os.path.join(bundle.PATCHES_DIR, diff)).decode("utf-8").split("\n+++ b/", 1)[1].split("\n")[0]
            assert {exit_paths()[v].place(role) for v in RELEASES if exit_paths()[v].role(role)[0] == diff} == {target}
    assert list(exit_paths()) == list(RELEASES)


ROW = "0.30.0"


@pytest.mark.parametrize("field, value", [
    ("launcher_path", "x/launcher.py"), ("launcher_path", "vllm/../launcher.py"), ("server_path", "vllm/./entry.py"),
    ("server_path", "vllm//entry.py"), ("server_path", "vllm/entry.txt"), ("launcher_diff", "../v0.30.0.diff"),
    ("server_diff", "v0.30.0.patch"), ("launcher_sha256", "0" * 63), ("launcher_fixed_sha256", "A" * 64),
    ("server_sha256", "0" * 31 + " " + "0" * 32), ("server_fixed_sha256", "g" * 64)])
def test_a_table_row_with_a_field_out_of_its_place_is_malformed(field, value):
    """A sealed row is still checked: the gate looks at the path it gives and reads the diff it names."""
    body = read(fetch_release.EXIT_PATH_TABLE).decode("utf-8").partition("\n")[2]
    lines = body.splitlines(keepends=True)
    header = next(line for line in lines if line.startswith("version\t")).rstrip("\n").split("\t")
    at = next(k for k, line in enumerate(lines) if line.startswith(ROW + "\t"))
    row = lines[at].rstrip("\n").split("\t")
    row[header.index(field)] = value
    lines[at] = "\t".join(row) + "\n"
    with pytest.raises(ValueError, match="malformed row"):
        read_exit_paths("".join(lines), None, sealed=False)
    assert read_exit_paths(body, None, sealed=False), "the table as it is reads"


def test_each_digest_of_a_row_is_64_digits_not_only_their_sum():
    """Two digests of 63 and 65 digits (a digit moved from one to the next) once passed a
    check of the row's four digests' total length."""
    body = read(fetch_release.EXIT_PATH_TABLE).decode("utf-8").partition("\n")[2]
    lines = body.splitlines(keepends=True)
    header = next(line for line in lines if line.startswith("version\t")).rstrip("\n").split("\t")
    at = next(k for k, line in enumerate(lines) if line.startswith(ROW + "\t"))
    row = lines[at].rstrip("\n").split("\t")
    release, fixed = header.index("launcher_sha256"), header.index("launcher_fixed_sha256")
    row[release], row[fixed] = row[release][:-1], row[release][-1] + row[fixed]
    lines[at] = "\t".join(row) + "\n"
    with pytest.raises(ValueError, match=f"malformed row: '{ROW}'"):
        read_exit_paths("".join(lines), None, sealed=False)


def contradicting(edit):
    """The exit table with the 0.30.0 row's launcher cells edited by edit(cells, rows), sealed again (as an editor would)."""
    def mangle(body: str) -> str:
        lines = body.splitlines(keepends=True)
        header = next(line for line in lines if line.startswith("version\t")).rstrip("\n").split("\t")
        rows = {line.split("\t", 1)[0]: line.rstrip("\n").split("\t") for line in lines[lines.index("\t".join(header) + "\n") + 1:]}
        columns = [header.index(f"launcher_{field}") for field in ("path", "diff", "sha256", "fixed_sha256")]
        cells = dict(zip(("path", "diff", "sha256", "fixed_sha256"), (rows[ROW][k] for k in columns)))
        edit(cells, {v: dict(zip(("path", "diff", "sha256", "fixed_sha256"), (r[k] for k in columns))) for v, r in rows.items()})
        for k, field in zip(columns, ("path", "diff", "sha256", "fixed_sha256")):
            rows[ROW][k] = cells[field]
        return "".join(lines[: lines.index("\t".join(header) + "\n") + 1]) + "".join("\t".join(r) + "\n" for r in rows.values())
    return mangle


def another_diff_s_file(cells, rows):
    other = next(r for r in rows.values() if r["diff"] != cells["diff"])
    cells["sha256"] = other["sha256"]


def its_diff_elsewhere(cells, rows):
    assert sum(r["diff"] == cells["diff"] for r in rows.values()) > 1, "the diff is another release's too"
    cells["path"] = "vllm/entrypoints/elsewhere.py"


CONTRADICTIONS = {
    "a-diff-with-two-paths": (its_diff_elsewhere, "gives patches/launcher/{diff} two paths"),
    "a-file-of-two-diffs": (another_diff_s_file, "gives a launcher file of"),
    "a-file-on-both-sides": (lambda cells, rows: cells.update(fixed_sha256=cells["sha256"]), "gives a launcher file of"),
}


@pytest.mark.parametrize("case", sorted(CONTRADICTIONS))
def test_a_table_whose_rows_contradict_each_other_is_a_malformed_bundle(case, make_tree, tmp_path, monkeypatch, capsys):
    """A table sealed after an edit that gives a diff two paths, or a file to two diffs or to
    both sides: the gate would decide a file by a row another row contradicts. 5 in every mode."""
    import apply
    from rank_exception_fatal import exit_path
    from rank_exception_fatal.seal import seal

    edit, complaint = CONTRADICTIONS[case]
    body = read(fetch_release.EXIT_PATH_TABLE).decode("utf-8").partition("\n")[2]
    table = tmp_path / "exit_path.tsv"
    table.write_text(seal(contradicting(edit)(body)))
    monkeypatch.setattr(exit_path, "EXIT_PATH_TABLE", str(table))
    root = make_tree(ROW)
    diff = exit_paths()[ROW].role("launcher")[0].partition("/")[2]
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert complaint.format(diff=diff) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("version, role", CASES, ids=[f"{v}-{r}" for v, r in CASES])
def test_diff_fixes_the_release_file_and_reverts(version, role, tmp_path):
    diff, release_sha256, fixed_sha256 = exit_paths()[version].role(role)
    diff_path = os.path.join(bundle.PATCHES_DIR, diff)
    path = exit_paths()[version].place(role)
    root = str(tmp_path)
    os.makedirs(os.path.dirname(os.path.join(root, path)))
    release = read(os.path.join(exit_path_tree(version), path))
    assert fetch_release.sha256(release) == release_sha256
    with open(os.path.join(root, path), "wb") as f:
        f.write(release)

    dry = run(root, "patch", "-p1", "-F0", "--dry-run", "-i", diff_path)
    assert dry.returncode == 0 and "fuzz" not in dry.stdout, dry.stdout + dry.stderr
    applied = run(root, "git", "apply", "-p1", diff_path)
    assert applied.returncode == 0, applied.stderr
    fixed = read(os.path.join(root, path))
    assert fetch_release.sha256(fixed) == fixed_sha256
    assert hooks_out_of_place(fixed.decode("utf-8"), role) == []
    assert hooks_out_of_place(release.decode("utf-8"), role) != []
    # What the script writes for this release: a diff of the same shape.
    assert shape(make_diff(release.decode("utf-8"), hooked(release.decode("utf-8"), role), path,
                           whole_functions=False)) == shape(read(diff_path).decode("utf-8"))
    assert run(root, "git", "apply", "-R", "-p1", diff_path).returncode == 0
    assert read(os.path.join(root, path)) == release
    assert run(root, "patch", "-p1", "-F0", "-s", "-i", diff_path).returncode == 0
    assert read(os.path.join(root, path)) == fixed


def test_helper_diff_is_the_creation_of_its_module(helper_root, tmp_path):
    text = read(os.path.join(helper_root, HELPER_PATH)).decode("utf-8")
    assert creation_diff(text, HELPER_PATH) == read(HELPER_DIFF).decode("utf-8")
    assert run(str(tmp_path), "patch", "-p1", "-F0", "-s", "-i", HELPER_DIFF).returncode == 0
    assert read(os.path.join(str(tmp_path), HELPER_PATH)) == text.encode("utf-8")
    # Standard library only: it imports, in an isolated Python, nothing of vLLM but itself.
    imported = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                               "import vllm.entrypoints._rank_exception_fatal; "
                               "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))", helper_root],
                              capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == str(["vllm", "vllm.entrypoints", "vllm.entrypoints._rank_exception_fatal"])


def server(helper_root: str, *steps: str, env: dict | None = None) -> tuple[int, list[str]]:
    """Run the stand-in API server through steps: (its exit status, its stdout lines)."""
    done = subprocess.run([sys.executable, os.path.join(TESTS, "exit_path_child.py"), helper_root, *steps],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


def last_event(lines: list[str]) -> dict:
    event = json.loads(lines[-1])
    assert set(event) == EVENT_KEYS
    assert event["event"] == "vllm.engine_died" and event["schema"] == 1 and event["exit_status"] == 1
    assert lines[-2].startswith("ERROR vllm.entrypoints._rank_exception_fatal: engine died: ")
    assert lines[-2].endswith("; the API server exits with status 1")
    return event


def test_a_death_the_server_saw_exits_1_with_the_two_lines_last(helper_root):
    status, lines = server(helper_root, "arm", "dead", "checked", "exit")
    assert status == 1, lines
    event = last_event(lines)
    assert event["cause"] == "engine-core-died" and event["rank"] is None
    assert "the engine core ended with no worker failure recorded" in lines[-2]


def test_the_event_goes_to_the_termination_message_file_where_there_is_one(helper_root, tmp_path):
    """Kubernetes mounts the pod's terminationMessagePath as a file: the event is in the
    pod's status whatever the log's last lines are. Where there is none, none is made."""
    message = tmp_path / "termination-log"
    message.write_text("")
    variable = {"RANK_EXCEPTION_FATAL_TERMINATION_LOG": str(message)}
    status, lines = server(helper_root, "arm", "dead", "checked", "exit", env=variable)
    assert status == 1 and json.loads(message.read_text()) == last_event(lines)
    message.write_text("")
    assert server(helper_root, "arm", "stop", "dead", "checked", "exit", env=variable)[0] == 0
    assert message.read_text() == "", "a stop writes nothing there"
    message.unlink()
    assert server(helper_root, "arm", "dead", "checked", "exit", env=variable)[0] == 1
    assert not message.exists()


def test_a_note_written_before_the_stop_exits_1_and_names_the_rank(helper_root):
    # The engine's side wrote the note; the stop came before the API server heard of the death.
    status, lines = server(helper_root, "arm", "note:rank-failed", "stop", "dead", "checked", "exit")
    assert status == 1, lines
    event = last_event(lines)
    assert (event["cause"], event["rank"], event["call"]) == ("rank-failed", 1, "execute_model")
    assert event["exception_message"] == "CUDA error: out of memory"  # its first line
    assert "rank 1 on node 0 (" in lines[-2] and "failed execute_model: RuntimeError: CUDA error" in lines[-2]


def test_a_worker_killed_before_the_stop_is_named_with_its_signal(helper_root):
    status, lines = server(helper_root, "arm", "note:worker-died:-9", "stop", "exit")
    assert status == 1, lines
    assert last_event(lines)["worker_exit_status"] == -9
    assert "died with status -9 (SIGKILL)" in lines[-2]


def test_a_stop_while_the_engine_was_alive_exits_0(helper_root):
    # A clean stop: its shutdown leaves the engine errored and not running, as the release's does,
    # and the watchdog may still look; a worker's note written after the stop began does not count.
    status, lines = server(helper_root, "arm", "stop", "dead", "checked", "note:rank-failed", "exit")
    assert status == 0, lines
    assert lines[-1] == "returned" and not any("engine died" in line for line in lines)


def test_a_stop_whose_requests_stay_open_gives_them_the_error_and_ends_with_0(helper_root):
    """vLLM's abort-mode stop cancels the engine client's output handler: its open requests
    would wait for ever, and uvicorn with them. They get the client's error, and the
    process ends soon after, with the status of a stop."""
    status, lines = server(helper_root, "arm", "serve-stop")
    assert status == 0, lines
    assert "answered EngineDeadError" in lines
    assert lines[-1].startswith("WARNING vllm.entrypoints._rank_exception_fatal: rank-exception-fatal: requests still"
                                " open 0.5 s after the engine stopped: exiting now with status 0"), lines


def test_a_stop_after_a_death_ends_with_1_and_its_two_lines_when_it_must_be_ended(helper_root):
    status, lines = server(helper_root, "arm", "dead", "checked", "serve-stop")
    assert status == 1, lines
    event = json.loads(next(line for line in lines if line.startswith("{")))
    assert event["cause"] == "engine-core-died"


@pytest.mark.parametrize("before, status", [((), 0), (("dead", "checked"), 1)])
def test_a_second_stop_signal_ends_the_process_at_once(before, status, helper_root):
    status_seen, lines = server(helper_root, "arm", *before, "stop", "sleep:2.5", "stop", "sleep:30")
    assert status_seen == status, lines
    assert f"a second stop signal: exiting now with status {status}" in lines[-1], lines


def test_a_stop_signal_forwarded_at_once_is_the_same_stop(helper_root):
    """vLLM's process managers pass a group's signal on to their children: the same stop,
    whose drain must not be cut."""
    status, lines = server(helper_root, "arm", "stop", "stop", "exit")
    assert status == 0 and lines[-1] == "returned", lines


def test_a_server_run_server_did_not_arm_keeps_the_release_s_stop(helper_root):
    """An API server process of several (run_server_worker, not run_server): no bound, and
    a second signal changes nothing, as in the release."""
    status, lines = server(helper_root, "stop", "sleep:2.5", "stop", "exit")
    assert status == 0 and lines[-1] == "returned", lines


def test_a_run_server_that_fails_during_the_stop_keeps_its_failure(helper_root):
    """The hook's exit must not land in the interpreter's own exit, where it would turn the
    failure's status into the stop's 0."""
    status, lines = server(helper_root, "arm", "serve-stop-raise")
    assert status == 1, lines
    assert not [line for line in lines if "exiting now" in line], lines


def test_the_output_handler_s_end_in_a_stop_is_not_logged_as_a_failure(helper_root):
    """When the stop's own shutdown ends the engine core before the client's output handler is
    cancelled, vLLM logs "AsyncLLM output_handler failed." with a traceback: in a stop of a
    live engine, said at INFO without it; after a death, kept as vLLM logs it."""
    status, lines = server(helper_root, "arm", "stop", "handler-failed", "exit")
    assert status == 0 and "INFO vllm.v1.engine.async_llm: AsyncLLM output_handler ended by the stop (RuntimeError)" in lines
    assert not [line for line in lines if "ERROR" in line or "Traceback" in line], lines
    status, lines = server(helper_root, "arm", "dead", "checked", "stop", "handler-failed", "exit")
    assert status == 1 and "ERROR vllm.v1.engine.async_llm: AsyncLLM output_handler failed." in lines, lines


def test_the_verdict_is_decided_once_whoever_asks(helper_root):
    """A death known from a cause note alone: the first verdict removes the notes, and a
    second asker (the hook's thread, run_server's end) must get the same answer."""
    status, lines = server(helper_root, "arm", "note:rank-failed", "stop", "say", "say")
    assert [line for line in lines if line.startswith("verdict")] == ["verdict True", "verdict True"], lines
    assert len([line for line in lines if line.startswith("{")]) == 1, "the two records, said once"


def test_keep_alive_still_latches_the_death_for_a_later_stop(helper_root):
    # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: the release does not exit, the watchdog's check still records it.
    status, lines = server(helper_root, "arm", "dead", "checked", "alive", "stop", "exit")
    assert status == 1, lines
    assert last_event(lines)["cause"] == "engine-core-died"


def test_a_signal_after_an_unheard_death_exits_1(helper_root):
    status, lines = server(helper_root, "arm", "dead", "stop", "exit")
    assert status == 1, lines


def test_an_engine_retired_on_purpose_is_not_a_death(helper_root):
    status, lines = server(helper_root, "arm", "retired", "checked", "stop", "exit")
    assert status == 0, lines


@pytest.mark.parametrize("layout", ["0.8.5", "0.9.0", "0.9.1"])
def test_a_group_stop_that_ended_the_engine_core_first_is_a_stop(helper_root, layout):
    # supervisord's stopasgroup, systemd's control-group kill: the engine core gets the SIGTERM
    # too and may end (status 0, or killed by it) before this server's handler runs. The
    # processes are where each release's client holds them.
    for code in ("0", "-15"):
        status, lines = server(helper_root, "arm", f"layout:{layout}", "dead", f"core:{code}", "checked", "stop", "exit")
        assert status == 0, (code, lines)
    # An engine core that failed, was killed otherwise, still runs after saying it died (the
    # stop waits STATUS_WAIT_SECONDS for its status), or whose status cannot be read: a death.
    for code in ("1", "-9", "running", "closed"):
        status, lines = server(helper_root, "arm", f"layout:{layout}", "dead", f"core:{code}", "stop", "exit")
        assert status == 1, (code, lines)


def test_the_stop_waits_for_an_engine_core_that_is_still_ending(helper_root):
    # The group's SIGTERM reached the engine core, which has not ended yet when this
    # server's handler looks: its status, when it comes, decides.
    assert server(helper_root, "arm", "dead", "core:ending:-15", "stop", "exit")[0] == 0
    assert server(helper_root, "arm", "dead", "core:ending:1", "stop", "exit")[0] == 1


def test_an_engine_core_ended_by_another_signal_is_a_death(helper_root):
    # Someone else's SIGTERM (an OOM daemon, a stray kill) ended the engine core: with no stop
    # of this server's, the watchdog's exit is a death; with keep-alive, so is a stop that
    # comes later than a group stop's would.
    status, lines = server(helper_root, "arm", "dead", "core:-15", "checked", "exit")
    assert status == 1, lines
    assert last_event(lines)["cause"] == "engine-core-died"
    status, lines = server(helper_root, "arm", "dead", "core:-15", "checked", "alive", "sleep:2.2", "stop", "exit")
    assert status == 1, lines


def test_a_note_written_during_the_drain_is_not_the_cause(helper_root):
    # The death was seen before the stop; a worker's note written while the stop drains is
    # not why the engine ended.
    status, lines = server(helper_root, "arm", "dead", "checked", "stop", "note:rank-failed", "exit")
    assert status == 1, lines
    assert last_event(lines)["cause"] == "engine-core-died" and last_event(lines)["rank"] is None


def test_the_hooks_never_raise_into_vllm(helper_root):
    # An engine whose state cannot be read: the release's own next statement must still run.
    status, lines = server(helper_root, "arm", "broken", "checked", "stop", "exit")
    assert (status, lines[-1]) == (0, "returned"), lines


def test_without_vllm_logging_both_lines_go_to_stderr(helper_root):
    done = subprocess.run([sys.executable, os.path.join(TESTS, "exit_path_child.py"), helper_root,
                           "no-vllm-logging", "arm", "dead", "checked", "exit"], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert "engine died: " in lines[-2] and json.loads(lines[-1])["event"] == "vllm.engine_died", lines


def test_with_vllm_logging_off_the_json_follows_the_roots_handler(helper_root):
    # VLLM_CONFIGURE_LOGGING=0 with the application's own handler on the root logger.
    status, lines = server(helper_root, "root-logging", "arm", "dead", "checked", "exit")
    assert status == 1, lines
    last_event(lines)


def test_notes_directories_are_fresh_and_only_ownerless_ones_go(helper_root):
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    prefix = f"rank-exception-fatal-{os.getuid()}-"
    made = {name: tempfile.mkdtemp(prefix=prefix, dir=base)
            for name in ("alive", "gone", "young", "making", "abandoned", "fifo", "not-0700")}
    # Another server's, alive: it holds its lock. One whose server is gone: nobody does. One
    # as young, which may be another server's between its mkdtemp and its lock. One being
    # made (no lock yet), one left without a lock for minutes, one whose lock is a FIFO
    # (opening it must not hang the start), one not made by mkdtemp (mode 0755).
    held = os.open(os.path.join(made["alive"], "owner.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    for name in ("gone", "young", "not-0700"):
        os.close(os.open(os.path.join(made[name], "owner.lock"), os.O_RDWR | os.O_CREAT))
    os.mkfifo(os.path.join(made["fifo"], "owner.lock"))
    os.chmod(made["not-0700"], 0o755)
    for name in ("alive", "gone", "abandoned", "fifo", "not-0700"):
        os.utime(made[name], (time.time() - 600, time.time() - 600))
    # Another server's note is not this server's cause.
    with open(os.path.join(made["alive"], "cause.json"), "w") as f:
        json.dump({"cause": "rank-failed", "time": 0}, f)
    try:
        status, lines = server(helper_root, "arm", "note:rank-failed", "note:worker-died:-9", "fork", "stop", "exit")
        notes = lines[0].split(" ", 1)[1]
        assert status == 1 and os.path.dirname(notes) == base and os.path.basename(notes).startswith(prefix)
        assert lines[1:3] == ["note written True", "note written False"]  # the first note wins
        assert lines[3] == "after the fork, notes True", "a forked child's exit leaves the server's directory"
        assert last_event(lines)["cause"] == "rank-failed"
        assert not os.path.exists(notes), "its own directory is removed at exit"
        assert {name for name, path in made.items() if not os.path.exists(path)} == {"gone", "abandoned"}
        # A clean stop next to another server's note: 0.
        assert server(helper_root, "arm", "stop", "exit")[0] == 0
    finally:
        os.close(held)
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)


def test_no_note_is_written_outside_an_armed_server(helper_root):
    env = {k: v for k, v in os.environ.items() if k != "RANK_EXCEPTION_FATAL_NOTES"}
    done = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "from vllm.entrypoints import _rank_exception_fatal as m; "
                           "print(m.write_note('rank-failed', rank=1))", helper_root],
                          capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "False", done.stderr
