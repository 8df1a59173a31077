"""What the loop probe and --verify stand in for around vLLM's own code: the executor the
worker monitor watches over, and a peer stuck in a collective with a dead rank."""
from __future__ import annotations

import signal
import threading
import time
import types


def stuck_in_a_collective() -> None:
    """A rank blocked in a collective with a peer that died: it never returns to Python,
    so SIGTERM does not reach it (on accelerators NCCL and HCCL wait so)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    while True:
        time.sleep(3600)


class StandInExecutor:
    """What start_worker_monitor reads and calls on a MultiprocExecutor; it records what
    the monitor did: whether it failed the executor, called shutdown() (when, and which
    workers were alive then) and the failure callback."""

    def __init__(self, workers, fault_tolerance=False) -> None:
        self.workers = workers
        # The fault-tolerance setting, on releases that have it ("absent" or None: none).
        setting = {} if fault_tolerance in (None, "absent") else {"enable_fault_tolerance": fault_tolerance}
        self.parallel_config = types.SimpleNamespace(**setting)
        self.is_failed = False
        self.shutting_down = False
        self.shutdown_called = False
        self.failed_at: float | None = None
        self.peers_alive_at_shutdown: list[bool] | None = None
        self.called_back = threading.Event()
        self.failure_callback = self.called_back.set

    def bind(self, methods: dict) -> None:
        """Make vLLM's functions (name -> function: start_worker_monitor and the methods it
        calls on its executor) this stand-in's methods."""
        for name, method in methods.items():
            setattr(self, name, types.MethodType(method, self))

    def shutdown(self) -> None:
        self.shutdown_called = True
        self.failed_at = time.monotonic()
        # A SIGKILL takes effect in the kernel a moment after kill() returns; vLLM's
        # shutdown() polls every 0.1 s, so allow one such poll.
        time.sleep(0.1)
        self.peers_alive_at_shutdown = [w.proc.is_alive() for w in self.workers]
