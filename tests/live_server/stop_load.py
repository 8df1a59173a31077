"""Requests in flight when a supervisor stops the server (tests/live_server/test_group_stop.py,
scripts/bench_stop.py): a server whose process group the API server leads, clients that keep
completions in flight, and what each in-flight request got. Test-only; standard library only."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time

from live_server.server import PROMPT, Server, group_alive, with_private_shm

CLIENTS = 4


class StopServer(Server):
    """server.Server with the API server itself as its process's leader: its exit status is
    the Popen's (Server.start wraps it in a shell that keeps the shell's status when a group
    signal reaches it too). Still in a /dev/shm of its own."""

    extra_args: list[str] = []

    def command(self) -> list[str]:
        return super().command() + self.extra_args

    def start(self) -> None:
        self.log = open(os.path.join(self.workdir, "server.log"), "w")
        self.proc = subprocess.Popen(
            with_private_shm(self.command()),  # `exec`: the Popen's pid is the API server
            env=self.environment(), cwd=self.workdir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._read_output, daemon=True).start()

    def kill_group(self) -> None:
        """SIGKILL what is left of the group, then close the log (instead of Server.stop,
        which reads the shell's list of /dev/shm leftovers that this start does not make)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.proc.wait()
        self._stop_polling.set()
        deadline = time.monotonic() + 5
        while self.exited_at is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the reader's last lines
        self.log.close()


def completion(port: int, model: str, max_tokens: int, timeout: float) -> dict:
    """One non-streamed completion: {"outcome": full|abort|http<N>|reset|timeout|refused|error, ...}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read().decode("utf-8", "replace")
        if response.status != 200:
            return {"outcome": f"http{response.status}", "body": data[:200]}
        answer = json.loads(data)
        reason = answer["choices"][0]["finish_reason"]
        tokens = (answer.get("usage") or {}).get("completion_tokens")
        return {"outcome": "full" if reason in ("length", "stop") else str(reason), "tokens": tokens}
    except TimeoutError:
        return {"outcome": "timeout"}
    except ConnectionRefusedError:
        return {"outcome": "refused"}
    except (ConnectionError, http.client.HTTPException) as e:  # RemoteDisconnected, reset, IncompleteRead
        return {"outcome": "reset", "error": f"{type(e).__name__}: {e}"[:200]}
    except (OSError, ValueError, KeyError) as e:
        return {"outcome": "error", "error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        conn.close()


class Clients:
    """CLIENTS threads, each sending the next completion as soon as one ends, until stopped."""

    def __init__(self, port: int, model: str, max_tokens: int, timeout: float) -> None:
        self.args = (port, model, max_tokens, timeout)
        self.stopped = threading.Event()
        self.requests: list[list[dict]] = [[] for _ in range(CLIENTS)]
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(CLIENTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self, k: int) -> None:
        while not self.stopped.is_set():
            started = time.time()
            self.requests[k].append({"started": started, **completion(*self.args), "ended": time.time()})

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def in_flight_at(self, t0: float) -> list[dict]:
        """Each client's request that the stop met (started before it, not ended), in seconds after it."""
        found = []
        for requests in self.requests:
            met = [r for r in requests if r["started"] < t0 <= r["ended"]]
            if not met:
                found.append({"outcome": "none-in-flight"})
                continue
            r = dict(met[0])
            r["running_for"] = round(t0 - r.pop("started"), 2)
            r["answered_after"] = round(r.pop("ended") - t0, 2)
            found.append(r)
        return found


def warm_up(port: int, model: str, max_tokens: int) -> float:
    """Seconds that CLIENTS concurrent completions take on this server (the second of two rounds)."""
    took = 0.0
    for _ in range(2):
        clients = Clients(port, model, max_tokens, 120)
        started = time.time()
        threads = [threading.Thread(target=lambda k=k: clients.requests[k].append(completion(port, model, max_tokens, 120)))
                   for k in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        took = time.time() - started
        outcomes = [r[0]["outcome"] for r in clients.requests]
        if outcomes != ["full"] * CLIENTS:
            raise RuntimeError(f"warm-up completions: {outcomes}")
    return took


def wait_exit(server: StopServer, deadline: float) -> int | None:
    while time.time() < deadline:
        status = server.proc.poll()
        if status is not None:
            server.exit_seen = getattr(server, "exit_seen", None) or time.time()
            return status
        time.sleep(0.02)
    return None
