"""The child's side of the bundle's child processes (spawn.py starts them): each answers
as data, JSON on stdout (JSON event lines for a case, the exit code for --verify's
harness), so that no caller matches printed words."""
from __future__ import annotations

import sys
from collections.abc import Sequence


def main(args: Sequence[str]) -> int:
    import json

    verb, *rest = args
    if verb == "case":
        from .loop_probe.child import run_child

        run_child(rest[0], json.loads(rest[1]))
    elif verb == "behaviour":
        from .loop_probe.cases import behaviour

        print(json.dumps({"behaviour": behaviour(rest[0])}))
    elif verb == "prove":
        print(json.dumps(loop_test_verdict()))
    elif verb == "harness":
        from .verify import harness

        if rest[1]:
            sys.path.insert(0, rest[1])  # --root: import vllm from there
        return harness(rest[0])
    else:
        raise SystemExit(f"unknown child {verb!r}")
    return 0


def loop_test_verdict() -> dict:
    """The bundle's loop test (test_rank_exception_fatal, beside apply.py), run as an
    operator runs it: {"passed": every test ran and passed, "failed": [test names]}."""
    import io
    import unittest

    import test_rank_exception_fatal

    suite = unittest.defaultTestLoader.loadTestsFromModule(test_rank_exception_fatal)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    failed = [test_name(test) for test, _ in result.failures + result.errors]
    passed = result.wasSuccessful() and result.testsRun > 0 and not result.skipped
    return {"passed": passed, "failed": failed}


def test_name(test) -> str:
    """A test method's name (a subtest's too); for a class's set-up, "setUpClass"."""
    case = getattr(test, "test_case", test)
    return getattr(case, "_testMethodName", None) or str(case).split(" ")[0]
