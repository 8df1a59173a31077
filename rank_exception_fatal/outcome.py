"""The outcome vocabulary: the file fixed, the exit codes, the states, and the Report of a run."""
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

# How a report that only stale bytecode keeps from 0 starts: apply removes the .pyc and writes no source.
STALE_BYTECODE = "stale bytecode "

# Actions, as --json prints them.
NO_ACTION, APPLIED, REVERTED, WOULD_APPLY, VERIFIED = "none", "applied", "reverted", "would-apply", "verify"


class Failure(Exception):
    """Ends the run with a one-line message and a distinct exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# The records below are plain classes, not namedtuples: importing collections would cost
# the deploy gate a tenth of its run.


class Decision:
    """What to do with a file: state, applied, not-applied or drifted; fix: the Fix that
    matched (None when drifted)."""

    __slots__ = ("state", "fix")

    def __init__(self, state: str, fix) -> None:
        self.state, self.fix = state, fix

    def __repr__(self) -> str:
        return f"Decision(state={self.state!r}, fix={self.fix!r})"


class Report:
    """What a run found and did: exit code, state, the message, the action taken, the diff
    used, the file's bytes before and after, and whether the diff was placed by its own
    lines (adapted): the executor's. files: a FileReport for each file of the set (None:
    the executor's alone)."""

    __slots__ = ("code", "state", "message", "action", "diff", "before", "after", "adapted", "files")

    def __init__(self, *, code: int, state: str, message: str, action: str = NO_ACTION, diff: "str | None" = None,
                 before: "bytes | None" = None, after: "bytes | None" = None, adapted: bool = False,
                 files: "list[FileReport] | None" = None) -> None:
        self.code, self.state, self.message, self.action = code, state, message, action
        self.diff, self.before, self.after, self.adapted, self.files = diff, before, after, adapted, files

    def replaced(self, **changes) -> "Report":
        """A copy with the named fields changed."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        return Report(**{**fields, **changes})

    def __repr__(self) -> str:
        return f"Report(code={self.code!r}, state={self.state!r}, message={self.message!r}, action={self.action!r})"


class FileReport:
    """One file of the set in a Report: its role (executor, helper, launcher, server, queue), its
    absolute path, state, diff, whether the diff was adapted, and its bytes before and after
    the run (None: absent). --json prints each with the sha256s of those bytes, hashed
    only then: the gate prints none."""

    __slots__ = ("role", "path", "state", "diff", "adapted", "before", "after")

    def __init__(self, role: str, path: str, state: str, diff: "str | None", adapted: bool, before: "bytes | None",
                 after: "bytes | None") -> None:
        self.role, self.path, self.state, self.diff, self.adapted = role, path, state, diff, adapted
        self.before, self.after = before, after

    def __repr__(self) -> str:
        return f"FileReport({self.role!r}, {self.path!r}, {self.state!r})"
