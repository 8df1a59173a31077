"""The outcome vocabulary: the file fixed, the exit codes, the states, and the Report of a run."""
from __future__ import annotations

from collections import namedtuple

TARGET = "vllm/v1/executor/multiproc_executor.py"

# Exit codes (README and apply.py --help list them; fleet tooling reads them).
OK, NOT_APPLIED, DRIFTED = 0, 1, 2
TARGET_NOT_FOUND, CANNOT_READ_OR_WRITE, BAD_BUNDLE, USAGE = 3, 4, 5, 6
VERIFY_NOT_FAIL_FAST, VERIFY_CANNOT_IMPORT, CHANGED_AFTER_WRITE, NOT_A_SOURCE_FILE = 7, 8, 9, 10
VERIFY_CANNOT_RUN, OTHER_MOUNT_NAMESPACE = 11, 12

# States, as --json prints them.
APPLIED_STATE, NOT_APPLIED_STATE, DRIFTED_STATE = "applied", "not-applied", "drifted"
NEEDS_RESTART_STATE = "needs-restart"
FAILS_FAST_STATE, NOT_AFFECTED_STATE = "fails-fast", "not-affected"
ERROR_STATE = "error"
# --verify's verdicts, by its exit code.
VERIFY_STATES = {
    OK: "fails-fast",
    VERIFY_NOT_FAIL_FAST: "not-fail-fast",
    VERIFY_CANNOT_IMPORT: "cannot-import",
    VERIFY_CANNOT_RUN: "cannot-run",
}

# Actions, as --json prints them.
NO_ACTION, APPLIED, REVERTED, WOULD_APPLY, VERIFIED = "none", "applied", "reverted", "would-apply", "verify"


class Failure(Exception):
    """Ends the run with a one-line message and a distinct exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# What to do with a file: state, applied, not-applied or drifted; fix: the Fix that
# matched (None when drifted).
Decision = namedtuple("Decision", "state fix")

# What a run found and did: exit code, state, the message, the action taken, the diff
# used, the file's bytes before and after, and whether the diff was placed by its own
# lines (adapted). Built by keyword: Report(code=OK, state=APPLIED_STATE, message=...).
Report = namedtuple(
    "Report", "code state message action diff before after adapted", defaults=(NO_ACTION, None, None, None, False)
)
