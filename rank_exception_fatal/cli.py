"""The command line: arguments in, one Report out, printed as a line or as JSON; the exit
code says what happened to the file."""
import os
import sys

from .locate import Located, locate_for_process, locate_target
from .outcome import (BAD_BUNDLE, ERROR_STATE, NOT_APPLIED, OK, TARGET, TARGET_NOT_FOUND, USAGE, VERIFIED, VERIFY_STATES,
                      WOULD_APPLY, Failure, Report)

# Sequence is for annotations only: importing collections.abc costs the gate 2 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

USAGE_TEXT = """Apply, check or revert the rank-exception-fatal fix in vLLM's multiproc executor.

usage: apply.py [--root DIR | --pid PID] [--check | --revert | --diff | --verify] [--exact]
                [--executor-only] [--json]

Without a mode, applies the fix if it is not applied yet. The fix is five files of the
vllm package: vllm/v1/executor/multiproc_executor.py (a failing rank ends the engine);
the API server's exit path, so that vllm serve then exits 1 and says why: its launcher
and server file, and the module vllm/entrypoints/_rank_exception_fatal.py they import;
and the message queue, vllm/distributed/device_communicators/shm_broadcast.py, whose
sockets between nodes get a heartbeat, so that a node gone silent ends the engine too.
Found under --root (default: $GAUDI_FIXES_ROOT), or else in the vllm package this
Python would import, found without importing it.

options:
  --root DIR         the directory holding vllm/
  --pid PID          the file the running process PID (the server) would import, found
                     with its Python, environment and working directory
  --check            report only: 0 applied, 1 not applied, 2 drifted; with --pid, 0 only
                     if that process started after the file last changed
  --revert           put back the release's bytes
  --diff, --dry-run  print the change as a unified diff; write nothing
  --verify           run the installed vLLM's real worker loop and check that it fails fast
  --exact            fix only a file whose changed functions are a release's, byte for
                     byte; without it, a diff may also be placed by its own lines in a
                     build between releases, and is then proven by the loop test first
  --executor-only    the executor's file alone, as bundles before the exit path did:
                     vllm serve then exits 0 when the fix ends the engine
  --json             print one JSON object instead of the human line
  -h, --help         print this help

exit codes (for the set: the first error any file gives, else 2 if any drifted, else 1
if any is not applied, else 0):
  0  applied, or nothing to do: every file is fixed (the executor may also fail fast
     by its own code, or every rank reply its failure) (with --diff, done; with
     --verify, the installed vLLM fails fast)
  1  not applied (--check; also when an apply was cut short), or applied but stale
     bytecode would run the old code; with --check --pid also: the process started
     before a file (or a link on its path) last changed, so it still runs the code it
     loaded then (needs-restart)
  2  source drifted: a file matches no diff, or more than one way; nothing was written
  3  target not found: no vllm/v1/executor/multiproc_executor.py
  4  cannot read, lock or write a file, or keep its owner; nothing was written (checked
     for every file first; should the executor's own write then fail, the message says
     that the exit path was written: run again)
  5  malformed patch bundle (patches/ missing, a bad or cut diff, no unidiff)
  6  usage error
  7  --verify: the installed vLLM does not fail fast
  8  --verify: the installed vLLM cannot be imported
  9  another program changed a file of the fix during the run (read back other bytes
     after the write, or changed since it was decided: then nothing was written): run again
 10  Python imports a file of the fix from something else than its source file (a
     compiled module of any CPython beside it, a package directory, bytecode alone, a zip)
 11  --verify: the check could not run (its harness failed before a verdict)
 12  --pid: the process sees other files at its paths than here (a container
     seen from the host): run apply.py inside it; nothing was checked or written
"""


class UsageError(Exception):
    """Bad arguments: exit 6, with a one-line message."""


# Parsed by hand: argparse costs more than the rest of a --check run (~7 ms of
# imports and gettext look-ups), and its usage errors exit 2, which means drifted.
MODES = {"--check": "check", "--revert": "revert", "--diff": "diff", "--dry-run": "diff", "--verify": "verify"}


class Options:
    """The parsed command line. (A plain class: see outcome.Report.)"""

    __slots__ = ("root", "mode", "json", "help", "pid", "exact", "executor_only")

    def __init__(self, root: "str | None", mode: str, json: bool, help: bool, pid: "str | None", exact: bool,
                 executor_only: bool = False) -> None:
        self.root, self.mode, self.json, self.help, self.pid, self.exact = root, mode, json, help, pid, exact
        self.executor_only = executor_only


def parse_args(argv: "Sequence[str]") -> Options:
    root, mode, as_json, show_help = os.environ.get("GAUDI_FIXES_ROOT") or None, "apply", False, False
    pid, exact, executor_only = None, False, False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            show_help = True
        elif arg == "--root" or arg.startswith("--root="):
            root = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not root or root.startswith("-"):
                raise UsageError("--root needs a directory")
        elif arg == "--pid" or arg.startswith("--pid="):
            pid = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not pid.isdigit():
                raise UsageError("--pid needs the id of the running vLLM server")
        elif arg in MODES:
            if mode not in ("apply", MODES[arg]):
                raise UsageError(f"{arg} cannot go with --{mode}: choose one mode")
            mode = MODES[arg]
        elif arg == "--json":
            as_json = True
        elif arg == "--exact":
            exact = True
        elif arg == "--executor-only":
            executor_only = True
        else:
            raise UsageError(f"unknown argument {arg!r}")
    if pid and any(a == "--root" or a.startswith("--root=") for a in argv):
        raise UsageError("--pid cannot go with --root: the process says where its vllm is")
    if pid and mode == "verify":
        raise UsageError("--verify cannot go with --pid: run --verify with the server's Python")
    return Options(None if pid else root, mode, as_json, show_help, pid, exact, executor_only)


# The directory a patched API server exports to the processes it starts, for the fixed
# executor's cause note (docs/supervisor.md §2). The proofs run the fix's code in children
# of this process: they must never write into a live server's directory.
NOTES_VARIABLE = "RANK_EXCEPTION_FATAL_NOTES"


def main(argv: "Sequence[str] | None" = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.pop(NOTES_VARIABLE, None)
    try:
        args = parse_args(argv)
    except UsageError as e:
        report = Report(code=USAGE, state=ERROR_STATE, message=f"usage error: {e} (see --help)")
        if "--json" in argv:  # fleet tooling reads one object whatever went wrong
            print_json(report, None)
        else:
            emit(sys.stderr, f"apply.py: {report.message}")
        return USAGE
    if args.help:
        emit(sys.stdout, USAGE_TEXT.strip())
        return OK
    path = None
    try:
        located = locate_for_process(args.pid) if args.pid else Located(locate_target(args.root))
        path = located.path
        if not args.pid and not args.root:
            note_a_copy_here(path)
        report = run(args, located)
    except Failure as e:
        report = Report(code=e.code, state=ERROR_STATE, message=str(e))
        if e.code == TARGET_NOT_FOUND and path is None and not args.pid:  # no executor: vLLM may be uninstalled
            from .leftover import left_after_uninstall

            report = left_after_uninstall(args.root, args.mode == "revert", report)
    except (RecursionError, MemoryError) as e:  # a file nested past what Python's parser takes
        from .outcome import DRIFTED, DRIFTED_STATE

        report = Report(code=DRIFTED, state=DRIFTED_STATE,
                        message=f"source drifted: {path} cannot be read as Python ({type(e).__name__}); nothing was written")
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM or SIGHUP during --verify (after its clean-up)
        return 128 + getattr(e, "signum", 2)
    if args.json:
        print_json(report, path)
    elif report.action == VERIFIED:
        emit(sys.stdout, report.message)
    elif report.code in (OK, NOT_APPLIED) and report.state != ERROR_STATE:
        emit(sys.stdout, report.message if report.action == WOULD_APPLY or path is None else f"{report.message}: {path}")
    else:
        emit(sys.stderr, f"apply.py: {report.message}")
    # The code says what happened to the file, also when the report could not be printed.
    return report.code


def leave(argv: "Sequence[str]", code: int) -> None:
    """End the process now with code if the run was the gate (--check): by then it has
    closed every file it read and waited for every child it started, and the interpreter's
    teardown of the modules it imported would be a third of its cost over a bare start
    (scripts/bench_check.py). Returns for any other mode, under a tracer or profiler (a
    coverage run saves its data at exit), and when the output cannot be flushed, for the
    interpreter's own exit to report it."""
    try:
        if parse_args(argv).mode != "check" or sys.gettrace() is not None or sys.getprofile() is not None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
    except (UsageError, OSError, ValueError, AttributeError):  # AttributeError: a stream Python started without
        return
    os._exit(code)


def run(args: Options, located: Located) -> Report:
    """The mode's action on the located file. Each mode imports its own modules: the gate
    (--check on a known file) costs little more than starting Python."""
    # Where this process, or the one --pid names, caches bytecode.
    prefix = located.pycache_prefix or sys.pycache_prefix
    if args.mode == "verify":
        return run_verify(located.path, args.root)
    if not args.executor_only:
        return run_set(args, located.path, prefix)
    if args.mode == "check":
        from .check import run_check

        report = run_check(located.path, prefix, exact=args.exact)
        if args.pid and report.code == OK:
            from .running import as_running

            report = as_running(args.pid, located.path, report)
        return report
    from .bundle import read_bundle
    from .change import run_change, run_diff

    if args.mode == "diff":
        return run_diff(located.path, read_bundle(), exact=args.exact)
    return run_change(located.path, read_bundle(), prefix, revert=args.mode == "revert", exact=args.exact)


def run_set(args: Options, path: str, prefix: "str | None") -> Report:
    """The mode's action on the set of the fix's files (fileset)."""
    from . import fileset

    if args.pid:
        fileset.seen_alike_by(args.pid, path)
    if args.mode == "check":
        report = fileset.check_set(path, prefix, exact=args.exact)
        return fileset.running_set(args.pid, report) if args.pid and report.code == OK else report
    from .bundle import read_bundle

    if args.mode == "diff":
        return fileset.diff_set(path, read_bundle(), exact=args.exact)
    return fileset.change_set(path, read_bundle(), prefix, revert=args.mode == "revert", exact=args.exact)


def run_verify(path: str, root: "str | None") -> Report:
    """--verify: the installed vLLM's own worker loop, driven in a harness child."""
    try:
        from . import verify
    except (ImportError, SyntaxError) as e:
        raise Failure(BAD_BUNDLE, f"cannot load the bundle's verify module: {e}; copy the whole bundle") from None
    code, lines = verify.run(path, root)
    return Report(code=code, state=VERIFY_STATES[code], message=lines, action=VERIFIED)


def note_a_copy_here(path: str) -> None:
    """A server started from this directory with `python -m` imports ./vllm, not the
    package this Python finds: say so, as the gate answers for the latter only."""
    here = os.path.join(os.getcwd(), TARGET)
    if os.path.isfile(here) and os.path.realpath(here) != os.path.realpath(path):
        emit(
            sys.stderr,
            f"apply.py: note: {here} would be imported instead by a server started here with python -m;"
            " check what the server imports with --pid PID",
        )


def emit(stream, text: str) -> None:
    """Print text; if the stream cannot take it, say so on stderr and go on."""
    if stream is None:  # Python started with that descriptor closed
        if sys.stderr is not None and stream is not sys.stderr:
            emit(sys.stderr, "apply.py: cannot print the report: stdout is closed")
        return
    try:
        try:
            stream.write(text + "\n")
        except UnicodeEncodeError:  # e.g. PYTHONIOENCODING=ascii and a non-ASCII path
            encoding = stream.encoding or "ascii"
            stream.write((text + "\n").encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError) as e:
        if stream is not sys.stderr:
            emit(sys.stderr, f"apply.py: cannot print the report: {e}")
        try:
            # Python flushes the stream again on exit, and would end with status 120.
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass


def print_json(report: Report, path: "str | None") -> None:
    import json

    from .seal import sha256_hex

    def digest(data: "bytes | None") -> "str | None":
        return None if data is None else sha256_hex(data)

    from .installed import installed_distribution

    distribution = installed_distribution(path) if path else None
    emit(sys.stdout, json.dumps({
        "state": report.state,
        "action": report.action,
        "path": path,
        "distribution": distribution.name if distribution else None,
        "version": distribution.version if distribution else None,
        "diff": report.diff,
        "adapted": report.adapted,
        "sha256_before": digest(report.before),
        "sha256_after": digest(report.after),
        "files": None if report.files is None else [
            {"role": file.role, "path": file.path, "state": file.state, "diff": file.diff, "adapted": file.adapted,
             "sha256_before": digest(file.before), "sha256_after": digest(file.after)} for file in report.files],
        "message": report.message,
        "exit_code": report.code,
    }))
