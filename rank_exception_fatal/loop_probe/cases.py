"""The probe's cases: one case run in a child (or a fork of a process that extracted the
loop already), its Outcome, and behaviour(): the whole matrix of ranks, calls and
exception types, judged as exits, replies, drops or unknown."""
from __future__ import annotations

import ast
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time

from ..spawn import child_command
from .child import CASE_TIMEOUT_SECONDS, ERRORS, QueueDrained, drive, emit, prepare
from .extract import LOGGER_NAME, request_size, uses_rank0_only, worker_proc_class


class Outcome:
    def __init__(self, returncode, stdout, stderr, timed_out):
        self.returncode = returncode
        self.events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        self.stderr = stderr
        self.timed_out = timed_out

    @property
    def ran(self):
        return [e["ran"] for e in self.events if "ran" in e]

    @property
    def replies(self):
        return [e for e in self.events if "reply" in e]

    @property
    def escaped(self):
        return [e["escaped"] for e in self.events if "escaped" in e]

    @property
    def drained(self):
        return any(e.get("drained") for e in self.events)

    def error_lines(self):
        return [
            line
            for line in self.stderr.splitlines()
            if line.startswith("ERROR ") and "WorkerProc hit an exception." not in line
        ]

    def __str__(self):
        return f"exit status {self.returncode}, events {self.events}\nstderr:\n{self.stderr}"


def run_case(target, rank=None, calls=(), *, fault_tolerance=None, blocking_teardown=False, monitor=False,
             engine_on_another_node=False, worker_ends="1", env=None):
    """One case, in a child Python: the fix ends the process, so a case cannot run in this one.
    monitor: True runs the executor's worker monitor in its thread, "inline" as a headless
    node runs it, and worker_ends says how its worker ends (child.ends_as: "1", "SIGKILL"...);
    engine_on_another_node: the worker's replies go to another node; env: the
    child's whole environment, its PYTHONPATH included (default: this process's, which an
    isolated child reads nothing of but the modules' search path it starts with)."""
    case = {
        "rank": rank,
        "calls": calls,
        "fault_tolerance": fault_tolerance,
        "blocking_teardown": blocking_teardown,
        "monitor": monitor,
        "engine_on_another_node": engine_on_another_node,
        "worker_ends": worker_ends,
    }
    command = child_command("case", target, json.dumps(case), flags=("-I",) if env is None else ("-s",))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CASE_TIMEOUT_SECONDS, env=env)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return Outcome(None, stdout, stderr, timed_out=True)
    return Outcome(done.returncode, done.stdout, done.stderr, timed_out=False)


def run_forked(target: str, prepared, case: dict) -> Outcome:
    """One case in a fork of this process, which has the loop extracted already: the
    judgement's matrix is hundreds of cases, and a fresh Python each would take minutes."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            try:
                drive(target, *prepared, case)
            except QueueDrained:
                emit(drained=True)
            except BaseException as e:
                emit(escaped=f"{type(e).__name__}: {e}")
                sys.stdout.flush()
                os._exit(70)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
    os.close(write_end)
    chunks, deadline, timed_out = [], time.monotonic() + CASE_TIMEOUT_SECONDS, False
    import select

    with os.fdopen(read_end, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode("utf-8", "replace")
    return Outcome(None if timed_out else os.waitstatus_to_exitcode(status), text, text, timed_out)


def one_rank_calls(text: str, cls: ast.ClassDef) -> list[dict]:
    """The model steps the executor sends with one output rank, as the file has them:
    execute_model, sample_tokens (0.11.1 on) and execute_dummy_batch where its
    executor sends that. (A pickled callable or a utility call comes from the engine's
    collective_rpc, which every rank answers: those are all-rank calls below.)"""
    calls = [{"method": "execute_model"}]
    if '"sample_tokens"' in text:
        calls.append({"method": "sample_tokens", "fail": ["sample_tokens"]})
    if '"execute_dummy_batch"' in text:
        calls.append({"method": "execute_dummy_batch", "fail": ["execute_dummy_batch"]})
    return calls


ALL_RANK_CALLS = [
    {"method": "execute_model"},  # with a KV or EC connector every rank answers a step
    {"method": "failing_pickled_step", "pickled": True},
    {"method": "check_health", "fail": ["check_health"]},
]
WORLD_SIZE = 4


def behaviour(target: str) -> str:
    """What a file's worker loop does when a call fails, driven as the tests drive it, on
    the class as __init__ leaves it (with fault tolerance off, where the file has it):
    every rank of a world of WORLD_SIZE failing each call the executor sends, with each
    of ERRORS, against output rank 0, 1 and 2, and on calls that every rank answers.

    "exits": for a call with one output rank, every other rank that fails it exits with
    status 1 and sends nothing, and the output rank replies its failure (then goes on
    or exits); every rank replies its failure to a call every rank answers (then goes
    on or exits); a call that succeeds goes on. "replies": a loop whose calls every rank
    answers (before 0.8.5: no output rank at all), where every failing rank replies and
    goes on. "drops": a failure that no one reads, on a rank that goes on (this bug,
    also where a rank replies to a call whose reply the executor does not read).
    "unknown": anything else, a loop these cases cannot drive, or one whose class
    __init__ sets a switch the loop reads from something other than fault tolerance.
    apply.py asks this of a file that no diff fits, in a child (children.py: behaviour)."""
    try:
        with open(target, encoding="utf-8-sig") as f:
            text = f.read()
        cls = worker_proc_class(ast.parse(text))
        prepared = prepare(target)
    except Exception:
        return "unknown"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    setting = False if "enable_fault_tolerance" in text else None  # off, where the file has it
    run = functools.partial(run_one, target, prepared, setting)
    if not all(replied(run(rank, call, None, error))
               for rank in range(WORLD_SIZE) for error in sorted(ERRORS) for call in ALL_RANK_CALLS):
        return "unknown"
    if request_size(cls) == 3:  # every rank answers every call
        return "replies"
    for output_rank in [0] if uses_rank0_only(cls) else [0, 1, 2]:
        for rank in range(WORLD_SIZE):
            verdict = one_rank_verdict(run, one_rank_calls(text, cls), rank, output_rank)
            if verdict:
                return verdict
    return "exits"


def one_rank_verdict(run, calls: list[dict], rank: int, output_rank: int) -> str | None:
    """How this rank handles calls with this output rank: None if as a fixed loop does
    (a healthy call goes on; a failure is replied by the output rank, ends any other),
    else "drops" or "unknown"."""
    healthy = run(rank, {}, output_rank, succeed=True)
    expected = [{"reply": "success", "value": "token-7"}] if rank == output_rank else []
    if not (dropped(healthy) and healthy.replies == expected):
        return "unknown"  # a loop that fails healthy calls is no fix
    for call in calls:
        for error in sorted(ERRORS):
            outcome = run(rank, call, output_rank, error)
            if rank == output_rank:
                if not replied(outcome):
                    return "unknown"
            elif dropped(outcome):
                return "drops"  # replied to no reader, or not at all, and served on
            elif not (outcome.returncode == 1 and not outcome.replies and clean(outcome)):
                return "unknown"
    return None


def run_one(target: str, prepared, setting, rank: int, call: dict, output_rank, error=None, succeed=False) -> Outcome:
    """One call on one rank, in a fork: the call, or (succeed) a healthy sample_tokens."""
    step = {"method": "sample_tokens"} if succeed else call
    case = {"rank": rank, "calls": [{**step, "output_rank": output_rank}], "fail": step.get("fail"),
            "fault_tolerance": setting, "error": error}
    return run_forked(target, prepared, case)


def clean(outcome: Outcome) -> bool:
    return not outcome.escaped and not outcome.timed_out


def replied(outcome: Outcome) -> bool:
    """Its failure reaches the caller; the rank may go on, or exit once it has replied."""
    return (clean(outcome) and [r["reply"] for r in outcome.replies] == ["failure"]
            and ((outcome.returncode == 0 and outcome.drained) or outcome.returncode == 1))


def dropped(outcome: Outcome) -> bool:
    return clean(outcome) and outcome.returncode == 0 and outcome.drained
