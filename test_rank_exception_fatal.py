"""Drive vLLM's real worker RPC loop and check that a failing non-output rank exits.

The loop is taken from vllm/v1/executor/multiproc_executor.py with ast (every
release shape from 0.8.5 on: the loop inline in WorkerProc.worker_busy_loop or
calling WorkerProc._execute_worker_rpc; replying through handle_output or
straight onto worker_response_mq; reading the call's output rank, or 0.8.5's
rank0_only flag), bound to a stand-in worker process and fed from a fake
broadcast queue, one child Python process per case: the fix ends the process,
so a case cannot run in the test's own. (The probe that does so is the bundle's
package, rank_exception_fatal.loop_probe: extract, child and cases; apply.py
proves an adapted change with these tests, and judges a file no diff fits with it.)

The executor's worker monitor (MultiprocExecutor.start_worker_monitor) is taken
the same way and run on a stand-in executor whose workers are real processes:
when one dies, the monitor must end its peers before it calls shutdown(), which
would otherwise wait seconds for a peer stuck in a collective before it
releases the engine.

Where the release has parallel_config.enable_fault_tolerance (0.27.0 on), the
fix must keep the release's behaviour with it on; both settings are run. Whether
the release has it: $RANK_EXCEPTION_FATAL_FAULT_TOLERANCE (yes/no, as
releases/releases.tsv says) when set, else the release's own vllm/config beside
the target, else whether the target file mentions it.

Target: $GAUDI_FIXES_ROOT/vllm/... when GAUDI_FIXES_ROOT is set, else the
installed vLLM, located without importing it (importing vLLM needs torch and a
device). Standard library only; runs under pytest, `python3 -m unittest` or as
`python3 test_rank_exception_fatal.py`.
"""
from __future__ import annotations

import ast
import collections
import functools
import inspect
import itertools
import os
import sys
import threading
import time
import types
import unittest
import unittest.mock

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # the bundle, whose package this test drives

from rank_exception_fatal.locate import locate_target  # noqa: E402
from rank_exception_fatal.loop_probe.cases import run_case  # noqa: E402
from rank_exception_fatal.loop_probe.child import CASE_TIMEOUT_SECONDS  # noqa: E402
from rank_exception_fatal.loop_probe.extract import (ResponseStatus, extract_collective_rpc,  # noqa: E402
                                               extract_worker_monitor,
                                               fault_tolerance_statements, future_reads, handle_fields,
                                               has_sample_tokens, release_has_fault_tolerance,
                                               runs_across_nodes, uses_rank0_only, worker_proc_class)
from rank_exception_fatal.outcome import TARGET, Failure  # noqa: E402


def find_target() -> str | None:
    """The file under $GAUDI_FIXES_ROOT (whether or not it is there), else the one this
    Python would import, found as apply.py finds it; None if there is none."""
    root = os.environ.get("GAUDI_FIXES_ROOT")
    if root:
        return os.path.join(root, TARGET)
    try:
        return locate_target(None)
    except Failure:
        return None


class WorkerLoopTest(unittest.TestCase):
    target: str

    @classmethod
    def setUpClass(cls):
        target = find_target()
        if target is None:
            raise unittest.SkipTest(
                "no vLLM to test: set GAUDI_FIXES_ROOT to the directory holding vllm/, "
                "or install vllm"
            )
        if not os.path.isfile(target):
            raise AssertionError(f"{target} does not exist (GAUDI_FIXES_ROOT points elsewhere?)")
        cls.target = target
        with open(target, encoding="utf-8-sig") as f:
            cls.worker_proc = worker_proc_class(ast.parse(f.read()))
        # A call answered by one rank other than 0, where the release can say so.
        cls.other_output_rank = 0 if uses_rank0_only(cls.worker_proc) else 1
        cls.multi_node = runs_on_several_nodes(target)

    def run_case(self, rank=None, calls=(), *, fault_tolerance=None, blocking_teardown=False, monitor=False,
                 engine_on_another_node=False):
        return run_case(self.target, rank, calls, fault_tolerance=fault_tolerance,
                        blocking_teardown=blocking_teardown, monitor=monitor,
                        engine_on_another_node=engine_on_another_node)

    def assert_exited_for(self, outcome, *, rank, method, output_rank, ran):
        self.assertFalse(outcome.timed_out, f"the worker did not end within {CASE_TIMEOUT_SECONDS}s: {outcome}")
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.escaped, [], f"the worker must exit, not raise: {outcome}")
        self.assertEqual(outcome.ran, ran, f"no queued call may run after the failure: {outcome}")
        self.assertEqual(outcome.replies, [], f"a non-output rank must not reply: {outcome}")
        self.assertIn("WorkerProc hit an exception.", outcome.stderr, "the traceback log is kept")
        lines = outcome.error_lines()
        self.assertEqual(len(lines), 1, f"one ERROR line about exiting: {outcome}")
        line = lines[0]
        self.assertRegex(line, rf"(?i)\brank {rank}\b")
        self.assertRegex(line, rf"(?i)\brank {output_rank}\b")
        self.assertIn(method, line)
        self.assertRegex(line, r"(?i)\bexit")

    def test_failing_non_output_rank_exits(self):
        outcome = self.run_case(
            2,
            [
                {"method": "execute_model", "output_rank": 0},
                {"method": "sample_tokens", "output_rank": 0},
            ],
        )
        self.assert_exited_for(outcome, rank=2, method="execute_model", output_rank=0, ran=["execute_model"])

    def test_a_rank_on_another_node_replies_its_failure_then_exits(self):
        # Multi-node (0.11.1 on): the engine's executor sees a worker on another node go only
        # as its connection drops, and ends the engine with the failure this rank sends first.
        if not self.multi_node:
            return
        calls = [{"method": "execute_model", "output_rank": 0}, {"method": "sample_tokens", "output_rank": 0}]
        outcome = self.run_case(1, calls, engine_on_another_node=True)
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.ran, ["execute_model"], str(outcome))
        self.assertEqual([(r["reply"], r.get("message")) for r in outcome.replies],
                         [("failure", "device out of memory during prefill")], str(outcome))

    def test_exit_does_not_wait_for_a_blocked_teardown(self):
        outcome = self.run_case(
            1,
            [
                {"method": "execute_model", "output_rank": 0},
                {"method": "sample_tokens", "output_rank": 0},
            ],
            blocking_teardown=True,
        )
        self.assert_exited_for(outcome, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])

    def test_failing_output_rank_replies_and_goes_on(self):
        rank = self.other_output_rank
        outcome = self.run_case(
            rank,
            [
                {"method": "execute_model", "output_rank": rank},
                {"method": "pickled_step", "output_rank": rank, "pickled": True},
            ],
        )
        self.assertEqual(outcome.returncode, 0, str(outcome))
        self.assertEqual(outcome.ran, ["execute_model", "pickled_step"])
        self.assertEqual(
            outcome.replies,
            [
                {"reply": "failure", "message": "device out of memory during prefill"},
                {"reply": "success", "value": "pickled-ok"},
            ],
        )
        self.assertTrue(outcome.drained)
        self.assertEqual(outcome.error_lines(), [])

    def test_failing_all_rank_call_replies_and_goes_on(self):
        # A call every rank answers that is not a model step (a health check, a LoRA
        # load): each rank replies its failure and serves on; so does rank 0, read
        # first, on a model step every rank answers.
        for rank, failing in ((3, {"method": "failing_pickled_step", "pickled": True}),
                              (0, {"method": "execute_model"})):
            with self.subTest(rank=rank, method=failing["method"]):
                outcome = self.run_case(
                    rank,
                    [
                        {**failing, "output_rank": None},
                        {"method": "pickled_step", "output_rank": None, "pickled": True},
                    ],
                )
                self.assertEqual(outcome.returncode, 0, str(outcome))
                self.assertEqual(outcome.ran, [failing["method"], "pickled_step"])
                self.assertEqual([r["reply"] for r in outcome.replies], ["failure", "success"])
                self.assertTrue(outcome.drained)
                self.assertEqual(outcome.error_lines(), [])

    def test_failing_all_rank_step_replies_then_exits(self):
        # A model step every rank answers (a KV or EC connector): the executor reads
        # rank 0 first, which may wait in a collective for the failed rank. That rank
        # replies its failure, for the engine to end with, then exits.
        if not has_sample_tokens(self.target):
            return  # before 0.11.1 no model step is answered by every rank
        outcome = self.run_case(3, self.step_calls(None))
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.escaped, [], str(outcome))
        self.assertEqual(outcome.ran, ["execute_model"], f"no queued call may run after the failure: {outcome}")
        self.assertEqual(outcome.replies, [{"reply": "failure", "message": "device out of memory during prefill"}])
        [line] = outcome.error_lines() or [str(outcome)]
        self.assertRegex(line, r"\bRank 3 failed execute_model\b.*\bexit")

    def test_failing_all_rank_start_up_call_replies_then_exits(self):
        # A start-up call (warm-up, memory profiling, KV cache set-up) that every rank
        # answers: a rank stuck in a collective with the failed one would hold the
        # server's start for good, as these calls have no timeout.
        if not has_sample_tokens(self.target):
            return  # the fix covers start-up calls from 0.11.1
        outcome = self.run_case(2, [{"method": "compile_or_warm_up_model", "output_rank": None},
                                    {"method": "pickled_step", "output_rank": None, "pickled": True}])
        self.assertEqual(outcome.returncode, 1, f"the worker must exit with status 1: {outcome}")
        self.assertEqual(outcome.ran, ["compile_or_warm_up_model"], str(outcome))
        self.assertEqual(outcome.replies, [{"reply": "failure", "message": "warm-up failed: device out of memory"}])
        [line] = outcome.error_lines() or [str(outcome)]
        self.assertRegex(line, r"\bRank 2 failed compile_or_warm_up_model\b.*\bexit")

    def assert_step_fails_its_sampling(self, outcome, rank):
        """A rank that returned its execute_model failure answers that step's
        sample_tokens with it, without running the runner's, then serves on."""
        self.assertEqual(outcome.returncode, 0, str(outcome))
        self.assertEqual(outcome.ran, ["execute_model", "sample_tokens"], f"a step that never ran is not sampled: {outcome}")
        [exec_reply, sample_reply, next_sample] = outcome.replies or [None, None, None]
        self.assertEqual(exec_reply, {"reply": "failure", "message": "device out of memory during prefill"})
        self.assertEqual(sample_reply["reply"], "failure", str(outcome))
        self.assertIn("device out of memory during prefill", sample_reply["message"], "the worker's own error")
        self.assertRegex(sample_reply["message"], rf"\bexecute_model\b.*\brank {rank}\b")
        self.assertEqual(next_sample, {"reply": "success", "value": "token-7"}, "only that step's sampling fails")
        self.assertTrue(outcome.drained)
        self.assertEqual(outcome.error_lines(), [])

    def step_calls(self, output_rank):
        return [
            {"method": "execute_model", "output_rank": output_rank},
            {"method": "sample_tokens", "output_rank": output_rank},
            {"method": "sample_tokens", "output_rank": output_rank},
        ]

    def test_output_rank_fails_the_steps_sampling(self):
        # Async scheduling and pipeline parallelism read a step's execute_model
        # reply only if sample_tokens returns None; vLLM's V1 runner returns an
        # empty output for a step that never ran.
        if not has_sample_tokens(self.target):
            return  # before 0.11.1 execute_model returns the step's tokens itself
        rank = self.other_output_rank
        self.assert_step_fails_its_sampling(self.run_case(rank, self.step_calls(rank)), rank)

    def test_all_rank_step_fails_its_sampling(self):
        # With a KV or EC connector every rank replies to both calls; rank 0, read
        # first, serves on (a later rank exits: test_failing_all_rank_step_replies_then_exits).
        if not has_sample_tokens(self.target):
            return
        self.assert_step_fails_its_sampling(self.run_case(0, self.step_calls(None)), 0)

    def test_successes_are_unchanged(self):
        calls = [
            {"method": "sample_tokens", "output_rank": 0},
            {"method": "sample_tokens", "output_rank": None},
            {"method": "pickled_step", "output_rank": 0, "pickled": True},
        ]
        on_output_rank = self.run_case(0, calls)
        self.assertEqual(on_output_rank.returncode, 0, str(on_output_rank))
        self.assertEqual(on_output_rank.ran, ["sample_tokens", "sample_tokens", "pickled_step"])
        self.assertEqual(
            on_output_rank.replies,
            [
                {"reply": "success", "value": "token-7"},
                {"reply": "success", "value": "token-7"},
                {"reply": "success", "value": "pickled-ok"},
            ],
        )
        self.assertTrue(on_output_rank.drained)

        elsewhere = self.run_case(1, calls)
        self.assertEqual(elsewhere.returncode, 0, str(elsewhere))
        self.assertEqual(elsewhere.ran, ["sample_tokens", "sample_tokens", "pickled_step"])
        self.assertEqual(elsewhere.replies, [{"reply": "success", "value": "token-7"}])
        self.assertTrue(elsewhere.drained)

    def test_pickled_callable_is_named_by_its_own_name(self):
        outcome = self.run_case(
            1,
            [
                {"method": "sample_tokens", "output_rank": None},
                {"method": "failing_pickled_step", "output_rank": 0, "pickled": True},
                {"method": "sample_tokens", "output_rank": 0},
            ],
        )
        self.assertEqual(outcome.replies, [{"reply": "success", "value": "token-7"}], str(outcome))
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 1, str(outcome))
        self.assertEqual(outcome.ran, ["sample_tokens", "failing_pickled_step"])
        [line] = outcome.error_lines() or [""]
        self.assertIn("failing_pickled_step", line, str(outcome))
        self.assertNotIn("sample_tokens", line, "a name left over from the previous call")

    def test_fault_tolerance_setting(self):
        statements = fault_tolerance_statements(self.worker_proc)
        calls = [
            {"method": "execute_model", "output_rank": 0},
            {"method": "sample_tokens", "output_rank": 0},
        ]
        if not release_has_fault_tolerance(self.target):
            # Releases before 0.27.0 have no such setting: nothing may turn the exit off,
            # and a worker that reads it must not fail for want of it.
            absent = self.run_case(1, calls, fault_tolerance="absent")
            self.assert_exited_for(absent, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])
            return
        self.assertTrue(statements, "WorkerProc.__init__ must read parallel_config.enable_fault_tolerance")
        off = self.run_case(1, calls, fault_tolerance=False)
        self.assert_exited_for(off, rank=1, method="execute_model", output_rank=0, ran=["execute_model"])
        on = self.run_case(1, calls, fault_tolerance=True)
        self.assertEqual(on.returncode, 0, f"with fault tolerance the engine handles the failure: {on}")
        self.assertEqual(on.ran, ["execute_model", "sample_tokens"])
        self.assertEqual(on.replies, [])
        self.assertTrue(on.drained)
        # ... and the output rank samples a failed step as the release does.
        replying = self.run_case(0, self.step_calls(0)[:2], fault_tolerance=True)
        self.assertEqual(replying.ran, ["execute_model", "sample_tokens"], str(replying))
        self.assertEqual([r["reply"] for r in replying.replies], ["failure", "success"], str(replying))

    def assert_monitor(self, fault_tolerance, *, ends_peers):
        outcome = self.run_case(monitor=True, fault_tolerance=fault_tolerance)
        self.assertFalse(outcome.timed_out, str(outcome))
        self.assertEqual(outcome.returncode, 0, str(outcome))
        [at_shutdown] = [e["peers_alive_at_shutdown"] for e in outcome.events if "peers_alive_at_shutdown" in e] or [None]
        [after] = [e for e in outcome.events if "called_back" in e] or [{}]
        self.assertEqual(after, {"called_back": True, "is_failed": True}, f"the monitor must fail the executor: {outcome}")
        if ends_peers:
            self.assertEqual(at_shutdown, [False], f"the stuck peer must be ended before shutdown(): {outcome}")
        else:
            self.assertEqual(at_shutdown, [True], f"the release's order is kept: {outcome}")

    def test_worker_monitor_ends_the_peers_before_shutdown(self):
        if not release_has_fault_tolerance(self.target):
            self.assert_monitor("absent", ends_peers=True)
            return
        self.assert_monitor(False, ends_peers=True)
        self.assert_monitor(True, ends_peers=False)  # fault tolerance: the release's order


    def test_a_headless_node_exits_non_zero_when_a_worker_dies(self):
        # A node other than the engine's runs the worker monitor inline and ends when it
        # returns: with status 1, so that whatever runs the node restarts it.
        if not self.multi_node:
            return
        for fault_tolerance in (False, True) if release_has_fault_tolerance(self.target) else ("absent",):
            with self.subTest(fault_tolerance=fault_tolerance):
                outcome = self.run_case(monitor="inline", fault_tolerance=fault_tolerance)
                self.assertFalse(outcome.timed_out, str(outcome))
                # Fault tolerance: the release's exit, 0.
                self.assertEqual(outcome.returncode, 0 if fault_tolerance is True else 1, str(outcome))


def runs_on_several_nodes(path: str) -> bool:
    """Whether the release runs its executor across nodes (--nnodes, 0.11.1 on)."""
    with open(path, encoding="utf-8-sig") as f:
        return runs_across_nodes(f.read())


class TimedResponseQueue:
    """One rank's response queue: each reply can be read from its time on (seconds after
    the call); a rank with no reply left is stuck, as in a collective with a dead peer,
    until shutdown() cancels the read (0.20 on: MessageQueue.shutdown(); before: the
    executor's shutdown_event, passed as cancel). Records each read's timeout."""

    def __init__(self, *replies, late_by=0.0):
        self.replies = list(replies)  # (seconds, (status, value))
        self.started = time.monotonic()
        self.shut_down = False
        self.timeouts = []
        self.late_by = late_by  # how much later than its timeout a read that times out ends

    def dequeue(self, timeout=None, cancel=None, indefinite=False):
        self.timeouts.append(timeout)
        if timeout is not None and timeout < 0:
            timeout = 0
        end = time.monotonic() + (CASE_TIMEOUT_SECONDS if timeout is None else timeout)
        while True:
            if self.replies and time.monotonic() - self.started >= self.replies[0][0]:
                return self.replies.pop(0)[1]
            if self.shut_down or (cancel is not None and cancel.is_set()):
                raise RuntimeError("cancelled")
            if time.monotonic() >= end:
                time.sleep(self.late_by)
                raise TimeoutError
            time.sleep(0.005)

    def shutdown(self):
        self.shut_down = True

    def readable(self):
        """vLLM's non-blocking check (0.34 on): raises once the queue is shut down."""
        if self.shut_down:
            raise RuntimeError("cancelled")
        return bool(self.replies) and time.monotonic() - self.started >= self.replies[0][0]

    def spin_until_readable(self, pending, deadline):
        """As vLLM's: until a reply is due, pending is non-empty or the deadline; it
        does not look at shutdown (the caller rechecks readable())."""
        while not pending and time.monotonic() < deadline:
            if self.replies and time.monotonic() - self.started >= self.replies[0][0]:
                return
            time.sleep(0.001)


class RemoteResponseQueue(TimedResponseQueue):
    """A rank's queue read from another node, over zmq: shutdown() does not wake its read
    (vLLM's MessageQueue checks shutting_down for readers on its own node only). The
    monitor of its connection (FakeMonitorSocket) reports when the connection drops."""

    _is_remote_reader = True

    def __init__(self, *replies, late_by=0.0):
        super().__init__(*replies, late_by=late_by)
        self.connection = FakeMonitorSocket()
        self.remote_socket = types.SimpleNamespace(get_monitor_socket=lambda events: self.connection)

    def dequeue(self, timeout=None, cancel=None, indefinite=False):
        return super().dequeue(timeout)  # nor does the executor's cancel event (0.17 and older)

    def shutdown(self):
        self.flagged = True  # MessageQueue.shutdown() sets shutting_down: readable() raises

    flagged = False

    def readable(self):
        if self.flagged:
            raise RuntimeError("cancelled")
        return bool(self.replies) and time.monotonic() - self.started >= self.replies[0][0]


class FakeMonitorSocket:
    """What zmq's Socket.get_monitor_socket gives: one DISCONNECTED event, once drop()."""

    def __init__(self):
        self.dropped = threading.Event()
        self.reported = False

    def drop(self):
        self.dropped.set()

    def close(self, linger=None):
        pass


class FakePoller:
    def __init__(self):
        self.sockets = []

    def register(self, socket, flags):
        self.sockets.append(socket)

    def poll(self, timeout=None):
        end = time.monotonic() + (timeout or 0) / 1000
        while True:
            ready = [(socket, 1) for socket in self.sockets if socket.dropped.is_set() and not socket.reported]
            if ready or time.monotonic() >= end:
                return ready
            time.sleep(0.005)


def fake_zmq() -> dict:
    """sys.modules entries for the part of pyzmq the fix's watch of other nodes uses."""
    zmq = types.ModuleType("zmq")
    zmq.EVENT_DISCONNECTED, zmq.POLLIN = 512, 1
    zmq.ZMQError = type("ZMQError", (Exception,), {})
    zmq.Poller = FakePoller
    monitor = types.ModuleType("zmq.utils.monitor")

    def recv_monitor_message(socket):
        socket.reported = True
        return {"event": zmq.EVENT_DISCONNECTED, "value": 0, "endpoint": b"tcp://10.0.0.2:5555"}

    monitor.recv_monitor_message = recv_monitor_message
    zmq.utils = types.ModuleType("zmq.utils")
    zmq.utils.monitor = monitor
    return {"zmq": zmq, "zmq.utils": zmq.utils, "zmq.utils.monitor": monitor}


class StandInAggregator:
    """A KV or EC connector's aggregator: makes the call one that every rank answers."""

    def aggregate(self, outputs, output_rank=0):
        return list(outputs)


class StandInExecutor(types.SimpleNamespace):
    """The executor's state that collective_rpc reads; its watchers hold it by weak reference."""


def wait_as_the_engine_does(future, spin_seconds=1.0):
    """A step's result as EngineCoreProc._wait_for_output reads it: from 0.34.0, where the
    future has poll() and wait_briefly(), it polls for the step's first second, waiting
    briefly between polls, then blocks in result(); before, result() alone."""
    poll, wait_briefly = getattr(future, "poll", None), getattr(future, "wait_briefly", None)
    if poll is not None and wait_briefly is not None:
        pending, deadline = [], time.monotonic() + spin_seconds
        while not poll():
            if time.monotonic() >= deadline:
                break
            wait_briefly(pending, deadline)
    return future.result()


class ExecutorReadTest(unittest.TestCase):
    """The executor's read of a call that every rank answers, from the file's collective_rpc."""

    @classmethod
    def setUpClass(cls):
        target = find_target()
        if target is None:
            raise unittest.SkipTest("no vLLM to test: set GAUDI_FIXES_ROOT or install vllm")
        cls.target = target
        with open(target, encoding="utf-8-sig") as f:
            source = f.read()
        # From 0.11.1 one get_response() closure reads every reply, from the executor's
        # response_mqs (from its workers' queues on upstream main of 2025-11, vllm-tpu
        # 0.11.2rc1). 0.11.0 and older read each worker's reply in a get_response(w, ...)
        # of their own; their fix leaves that read alone, as a failing rank replies and
        # goes on there. Where it makes that rank exit after its reply (upstream main of
        # 2025-10, vllm-tpu 0.11.1), the read must end with the reply too.
        cls.reads_response_mqs = "def get_response():" in source or (
            "def get_response(\n" in source and "def _after_a_replied_failure(" in source
        )
        cls.collective_rpc = staticmethod(extract_collective_rpc(target)) if cls.reads_response_mqs else None
        parameters = inspect.signature(cls.collective_rpc).parameters if cls.reads_response_mqs else {}
        # A call every rank answers: with a connector's aggregator from 0.11.1, before
        # that with no reply rank (the executor's execute_model aggregated the list).
        cls.takes_aggregator = "kv_output_aggregator" in parameters
        # Before 0.11.1 a model step was not followed by a sample_tokens of its own.
        cls.remembers_a_failed_step = "futures_queue" in source
        # How the engine reads a step: from 0.34.0 it polls first (spins, then blocks in
        # result() once a second has passed: spin_seconds 0 is that later read).
        cls.engine_reads = (1.0, 0.0) if "poll" in future_reads(ast.parse(source)) else (0.0,)

    def executor(self, *queues, fault_tolerance=False):
        parallel_config = types.SimpleNamespace(enable_fault_tolerance=fault_tolerance)
        return StandInExecutor(
            rpc_broadcast_mq=types.SimpleNamespace(enqueue=lambda request: None),
            response_mqs=list(queues),
            workers=tuple(types.SimpleNamespace(worker_response_mq=queue) for queue in queues),
            io_thread_pool=None,
            is_failed=False,
            shutdown_event=threading.Event(),
            futures_queue=collections.deque(),
            parallel_config=parallel_config,
            vllm_config=types.SimpleNamespace(parallel_config=parallel_config),
        )

    def call(self, executor, method, timeout, aggregated=True, non_block=False, spin_seconds=None):
        """The call's result; with non_block, a future whose result() reads it (before
        0.11.1, where no call is sent ahead, one that makes the call then); with
        spin_seconds, the result read as the engine reads a step's."""
        if spin_seconds is not None:
            future = self.call(executor, method, timeout, aggregated, non_block=True)
            return wait_as_the_engine_does(future, spin_seconds)
        if not self.takes_aggregator:
            reply_rank = None if aggregated else 0
            read = functools.partial(self.collective_rpc, executor, method, timeout=timeout, args=(None,),
                                     unique_reply_rank=reply_rank)
            return types.SimpleNamespace(result=read) if non_block else read()
        extra = {"kv_output_aggregator": StandInAggregator()} if aggregated else {}
        return self.collective_rpc(executor, method, timeout=timeout, args=(None,), unique_reply_rank=0,
                                   non_block=non_block, **extra)

    def stuck_rank_0_failed_rank_1(self):
        return (
            TimedResponseQueue(),
            TimedResponseQueue((0, (ResponseStatus.FAILURE, "rank 1: device out of memory"))),
        )

    def shut_down_after(self, executor, seconds):
        """What the worker monitor does once the failed rank has exited: shutdown()."""

        def shut_down():
            time.sleep(seconds)
            executor.shutting_down = True  # shutdown()'s first step
            for worker in executor.workers:
                worker.worker_response_mq = None  # as shutdown() does, before it cancels a read
            executor.shutdown_event.set()
            for queue in executor.response_mqs:
                queue.shutdown()

        threading.Thread(target=shut_down, daemon=True).start()

    def test_a_failed_step_ends_with_the_workers_error(self):
        # Rank 1 replied its failure and exited; rank 0 waits in a collective for it
        # until the worker monitor's shutdown() cancels the read. The step ends with
        # rank 1's error, not the cancellation, and so does the step's next call, sent
        # before the shutdown (async scheduling sends it ahead) and read after it.
        if not self.reads_response_mqs:
            return
        methods = ("execute_model", "sample_tokens") if self.remembers_a_failed_step else ("execute_model",)
        for method, spin_seconds in itertools.product(methods, self.engine_reads):
            with self.subTest(method=method, spin_seconds=spin_seconds):
                executor = self.executor(*self.stuck_rank_0_failed_rank_1())
                calls = (method, "sample_tokens") if self.remembers_a_failed_step else (method,)
                self.shut_down_after(executor, 0.2)  # the calls below are sent well before it
                sent = [(call, self.call(executor, call, timeout=5, non_block=True)) for call in calls]
                for call, future in sent:
                    with self.assertRaises(Exception) as raised:
                        wait_as_the_engine_does(future, spin_seconds)
                    self.assertIsInstance(raised.exception, RuntimeError, repr(raised.exception))
                    self.assertIn("rank 1: device out of memory", str(raised.exception), call)

    def test_a_worker_lost_on_another_node_ends_the_step(self):
        # Multi-node: rank 1 runs on another node, and this node's rank 0, the output
        # rank, waits in a collective for it. When rank 1's connection drops, the
        # executor fails, ends this node's workers and shuts down, and the step ends at
        # once: with the failure rank 1 sent before it exited, or, killed, with none.
        if not self.reads_response_mqs or not runs_on_several_nodes(self.target):
            return
        watch = extract_worker_monitor(self.target).get("_watch_remote_workers")
        self.assertIsNotNone(watch, "the executor does not watch the workers on other nodes")
        failure = (ResponseStatus.FAILURE, "rank 1: device out of memory")
        cases = ((((0, failure),), "rank 1: device out of memory"), ((), None))
        for (sent, error), spin_seconds in itertools.product(cases, self.engine_reads):
            with self.subTest(replied=bool(sent), spin_seconds=spin_seconds):
                local, remote = TimedResponseQueue(), RemoteResponseQueue(*sent)
                executor = self.executor(local, remote)
                killed, called_back = [], threading.Event()
                executor.workers = (types.SimpleNamespace(
                    worker_response_mq=local, peer_worker_response_mqs=[None, remote],
                    proc=types.SimpleNamespace(kill=lambda: killed.append(0))),)
                executor.failure_callback = called_back.set

                def shutdown(executor=executor, local=local):
                    executor.shutting_down = True
                    executor.shutdown_event.set()
                    local.shutdown()
                    executor.response_mqs = []

                executor.shutdown = shutdown
                with unittest.mock.patch.dict(sys.modules, fake_zmq()):
                    watch(executor)
                threading.Timer(0.2, remote.connection.drop).start()
                started = time.monotonic()
                with self.assertRaises(RuntimeError) as raised:
                    self.call(executor, "execute_model", timeout=10, aggregated=False, spin_seconds=spin_seconds)
                self.assertLess(time.monotonic() - started, 3, "the step waited for its timeout")
                if error:
                    self.assertIn(error, str(raised.exception))
                self.assertTrue(executor.is_failed)
                self.assertTrue(called_back.is_set(), "the engine's failure callback")
                self.assertEqual(killed, [0], "this node's workers are ended")

    def test_the_watch_of_other_nodes_reads_fields_the_worker_handle_has(self):
        # The watch finds the workers of other nodes by a field of the executor's worker
        # handles, which the fix's hunks do not carry: a file whose handle names it
        # otherwise would silently watch nothing.
        if not self.reads_response_mqs or not runs_on_several_nodes(self.target):
            return
        with open(self.target, encoding="utf-8-sig") as f:
            tree = ast.parse(f.read())
        watch = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                      and node.name == "_watch_remote_workers"), None)
        self.assertIsNotNone(watch, "the executor does not watch the workers on other nodes")
        read = {call.args[1].value for call in ast.walk(watch) if isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name) and call.func.id == "getattr" and len(call.args) > 1
                and isinstance(call.args[1], ast.Constant) and ast.unparse(call.args[0]) == "self.workers[0]"}
        self.assertTrue(read, "the watch reads no field of the worker handles")
        self.assertLessEqual(read, handle_fields(tree), "fields the watch reads that WorkerProcHandle lacks")

    def test_a_cancelled_step_waits_once_for_all_remote_ranks(self):
        # A step every rank answers (a KV connector's), rank 0 here stuck in the
        # collective, ranks 1-4 on other nodes, also stuck: when shutdown() cancels the
        # read, the later ranks' queues are read for the failure behind it. A remote
        # read is not cancelled, so each would wait its whole timeout: the end must not
        # grow with the number of remote ranks. And when a remote worker was lost, its
        # reply (sent before its connection dropped) is read first.
        if not self.reads_response_mqs or not runs_on_several_nodes(self.target):
            return
        failure = (ResponseStatus.FAILURE, "rank 4: device out of memory")
        spin_seconds = 0.0  # the poll read ends in the same get_response(): the tests above drive it
        for lost_replied in (False, True):
            with self.subTest(lost_replied=lost_replied):
                remote = [RemoteResponseQueue() for _ in range(3)]
                remote.append(RemoteResponseQueue((0, failure)) if lost_replied else RemoteResponseQueue())
                executor = self.executor(TimedResponseQueue(), *remote)
                if lost_replied:
                    executor.lost_worker_mq = remote[-1]  # as the watch of other nodes sets it
                self.shut_down_after(executor, 0.2)
                started = time.monotonic()
                with self.assertRaises(RuntimeError) as raised:
                    self.call(executor, "execute_model", timeout=30, spin_seconds=spin_seconds)
                ended = time.monotonic() - started
                # The engine's own spin (wait_briefly) goes on to its deadline after a cancel.
                cancelled = max(0.2, spin_seconds)
                if lost_replied:
                    self.assertIn("rank 4: device out of memory", str(raised.exception))
                    self.assertLess(ended, cancelled + 0.5, "the lost worker's reply was read after the others")
                else:
                    self.assertLess(ended, cancelled + 1.5, "each remote rank was waited for in turn")

    def test_a_read_of_another_node_ends_with_the_executor(self):
        # Pipeline parallelism across nodes puts the output rank on another node, whose
        # read shutdown() does not wake: the read must end when the executor does. A
        # reply that takes a while is still read whole.
        if not self.reads_response_mqs or not runs_on_several_nodes(self.target):
            return
        success = ResponseStatus.SUCCESS
        executor = self.executor(TimedResponseQueue(), RemoteResponseQueue((0.35, (success, "rank 1"))))
        self.assertEqual(self.collective_rpc(executor, "execute_model", timeout=5, args=(None,),
                                             unique_reply_rank=1), "rank 1")
        executor = self.executor(TimedResponseQueue(), RemoteResponseQueue())
        self.shut_down_after(executor, 0.2)
        started = time.monotonic()
        with self.assertRaises(Exception) as raised:
            self.collective_rpc(executor, "execute_model", timeout=5, args=(None,), unique_reply_rank=1)
        self.assertIsInstance(raised.exception, RuntimeError, "the read waited for its timeout")
        self.assertLess(time.monotonic() - started, 2, "the read waited for its timeout")

    def test_a_read_of_another_node_times_out_as_the_release_s_does(self):
        # That read goes in slices of 0.1 s. A slice that ends late (a busy process)
        # must not leave the next one a negative timeout: before 0.30 vLLM's
        # MessageQueue passes it on to zmq, where a negative timeout waits for good.
        if not self.reads_response_mqs or not runs_on_several_nodes(self.target):
            return
        remote = RemoteResponseQueue(late_by=0.01)
        executor = self.executor(TimedResponseQueue(), remote)
        with self.assertRaises(TimeoutError):
            self.collective_rpc(executor, "execute_model", timeout=0.105, args=(None,), unique_reply_rank=1)
        self.assertGreaterEqual(min(remote.timeouts), 0, f"a read with a negative timeout: {remote.timeouts}")

    def test_a_healthy_step_reads_each_rank_once(self):
        # The release's read: one dequeue a rank with the call's deadline, never a
        # poll. A poll that gives up between a large reply's slot and its payload
        # (sent over zmq after it) would lose the reply.
        if not self.reads_response_mqs:
            return
        success = ResponseStatus.SUCCESS
        queues = (TimedResponseQueue((0.3, (success, "rank 0"))), TimedResponseQueue((0, (success, "rank 1"))))
        executor = self.executor(*queues)
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0", "rank 1"])
        for rank, queue in enumerate(queues):
            self.assertEqual(len(queue.timeouts), 1, f"rank {rank} read {queue.timeouts}")
            self.assertGreater(queue.timeouts[0], 4, f"rank {rank} read with the call's deadline")

    def test_replies_keep_rank_order_and_step(self):
        if not self.reads_response_mqs:
            return
        success = ResponseStatus.SUCCESS
        executor = self.executor(
            TimedResponseQueue((0.3, (success, "rank 0, step 1")), (0.3, (success, "rank 0, step 2"))),
            TimedResponseQueue((0, (success, "rank 1, step 1")), (0, (success, "rank 1, step 2"))),
        )
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0, step 1", "rank 1, step 1"])
        self.assertEqual(self.call(executor, "execute_model", timeout=5), ["rank 0, step 2", "rank 1, step 2"])

    def test_other_calls_and_fault_tolerance_keep_the_release_order(self):
        # A failing utility call does not end the engine: its replies are read in rank
        # order, as the release does. Under fault tolerance the engine handles a failed
        # step itself, and reads every rank.
        if not self.reads_response_mqs:
            return
        cases = [("check_health", False)]
        if release_has_fault_tolerance(self.target):
            cases.append(("execute_model", True))
        for method, fault_tolerance in cases:
            with self.subTest(method=method, fault_tolerance=fault_tolerance):
                executor = self.executor(*self.stuck_rank_0_failed_rank_1(), fault_tolerance=fault_tolerance)
                with self.assertRaises(TimeoutError):
                    self.call(executor, method, timeout=0.5)


if __name__ == "__main__":
    unittest.main()
