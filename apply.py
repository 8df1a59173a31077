#!/usr/bin/env python3
"""Apply, check or revert the rank-exception-fatal fix in vLLM's multiproc executor.

usage: apply.py [--root DIR] [--check | --revert | --diff | --verify] [--json]

Without a mode, applies the fix if it is not applied yet. Reads
vllm/v1/executor/multiproc_executor.py under --root (default: $GAUDI_FIXES_ROOT),
or else in the vllm package this Python would import, found without importing it.

options:
  --root DIR         the directory holding vllm/
  --check            report only: 0 applied, 1 not applied, 2 drifted
  --revert           put back the release's bytes
  --diff, --dry-run  print the change as a unified diff; write nothing
  --verify           run the installed vLLM's real worker loop and check that it fails fast
  --json             print one JSON object instead of the human line
  -h, --help         print this help

exit codes:
  0  applied (or, with --diff, done; with --verify, the installed vLLM fails fast)
  1  not applied (--check)
  2  source drifted: the file matches none of the diffs; nothing was written
  3  target not found: no vllm/v1/executor/multiproc_executor.py
  4  cannot read or write the target
  5  malformed patch bundle (patches/ missing or unreadable, bad diff, no unidiff)
  6  usage error
  7  --verify: the installed vLLM does not fail fast
  8  --verify: the installed vLLM cannot be imported
"""
from __future__ import annotations

import os
import sys
from collections import namedtuple
from collections.abc import Sequence

TARGET = "vllm/v1/executor/multiproc_executor.py"
PATCHES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")
TEMP_PREFIX = ".rank-exception-fatal-"

OK, NOT_APPLIED, DRIFTED = 0, 1, 2
TARGET_NOT_FOUND, CANNOT_READ_OR_WRITE, BAD_BUNDLE, USAGE = 3, 4, 5, 6
VERIFY_NOT_FAIL_FAST, VERIFY_CANNOT_IMPORT = 7, 8

APPLIED_STATE, NOT_APPLIED_STATE, DRIFTED_STATE = "applied", "not-applied", "drifted"


class Failure(Exception):
    """Ends the run with a one-line message and a distinct exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- locate -------------------------------------------------------------------


def locate_target(root: str | None) -> str:
    if root:
        path = os.path.join(root, TARGET)
        if not os.path.isfile(path):
            raise Failure(
                TARGET_NOT_FOUND,
                f"{path} not found: --root (or GAUDI_FIXES_ROOT) must be the directory holding vllm/",
            )
        return path
    import importlib.util

    # find_spec on a top-level name searches sys.path without running vllm/__init__.py,
    # which needs torch and a device and may fail on a node being repaired.
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise Failure(
            TARGET_NOT_FOUND,
            f"no vllm package for {sys.executable}: run this with the Python that serves vLLM, "
            "or pass --root DIR (the directory holding vllm/)",
        )
    path = os.path.join(spec.submodule_search_locations[0], *TARGET.split("/")[1:])
    if not os.path.isfile(path):
        raise Failure(TARGET_NOT_FOUND, f"{path} not found: this vllm has no multiprocessing executor")
    return path


def installed_version(path: str) -> str | None:
    """The vllm version from package metadata next to the tree; None for a bare source tree."""
    from importlib import metadata

    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path))))
    for distribution in metadata.distributions(name="vllm", path=[site]):
        return distribution.version
    return None


def read_bundle(directory: str | None = None) -> list[Fix]:
    directory = directory or PATCHES_DIR
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".diff"))
        texts = []
        for name in names:
            with open(os.path.join(directory, name), encoding="utf-8", newline="") as f:
                texts.append(f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the patch bundle in {directory}: {e}") from None
    if not names:
        raise Failure(BAD_BUNDLE, f"no .diff files in {directory}: the bundle is incomplete, copy it again")
    return [parse_fix(name, text) for name, text in zip(names, texts)]


# --- fingerprint ----------------------------------------------------------------


# before: the hunk's context and removed lines, the release's text; after: its
# context and added lines, the fixed text. Lines keep their "\n".
Hunk = namedtuple("Hunk", "before after")
# name: the diff's file name in patches/; hunks: its Hunks, in file order.
Fix = namedtuple("Fix", "name hunks")


def parse_fix(name: str, text: str) -> Fix:
    try:
        from unidiff import PatchSet
        from unidiff.errors import UnidiffParseError
    except ImportError:
        raise Failure(BAD_BUNDLE, "the unidiff package is missing: pip install unidiff") from None
    try:
        patch = PatchSet(text)
    except UnidiffParseError as e:
        raise Failure(BAD_BUNDLE, f"patches/{name} is not a unified diff: {e}") from None
    if len(patch) != 1 or patch[0].path != TARGET or not len(patch[0]):
        raise Failure(BAD_BUNDLE, f"patches/{name} must change {TARGET} and nothing else")
    hunks = tuple(
        Hunk(
            tuple(line.value for line in hunk.source_lines()),
            tuple(line.value for line in hunk.target_lines()),
        )
        for hunk in patch[0]
    )
    if any(hunk.before == hunk.after for hunk in hunks):
        raise Failure(BAD_BUNDLE, f"patches/{name} has a hunk that changes nothing")
    return Fix(name, hunks)


def split_lines(text: str) -> list[str]:
    # Only "\n" ends a line, as in the diffs: str.splitlines would also split on
    # form feeds and hide a CRLF file's "\r".
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def find_block(lines: Sequence[str], block: Sequence[str]) -> list[int]:
    size = len(block)
    return [
        i
        for i in range(len(lines) - size + 1)
        if lines[i] == block[0] and list(lines[i : i + size]) == list(block)
    ]


def locate_blocks(lines: Sequence[str], blocks: Sequence[Sequence[str]]) -> list[int] | None:
    """Where each block stands, if each stands exactly once and in order; else None."""
    starts = []
    end = 0
    for block in blocks:
        found = find_block(lines, block)
        if len(found) != 1 or found[0] < end:
            return None
        starts.append(found[0])
        end = found[0] + len(block)
    return starts


def fingerprint(lines: Sequence[str], fix: Fix) -> str | None:
    # Each hunk carries the whole function it changes as context, so finding every
    # hunk exactly means those functions are byte-identical to the release's.
    if locate_blocks(lines, [hunk.before for hunk in fix.hunks]) is not None:
        return NOT_APPLIED_STATE
    if locate_blocks(lines, [hunk.after for hunk in fix.hunks]) is not None:
        return APPLIED_STATE
    return None


# --- decide -----------------------------------------------------------------------


# state: applied, not-applied or drifted; fix: the Fix that matched (None when drifted).
Decision = namedtuple("Decision", "state fix")


def decide(text: str | None, fixes: Sequence[Fix]) -> Decision:
    """What to do with the file's text (None: not UTF-8, which no release is)."""
    if text is None:
        return Decision(DRIFTED_STATE, None)
    lines = split_lines(text)
    states = [(fix, fingerprint(lines, fix)) for fix in fixes]
    for fix, state in states:
        if state == APPLIED_STATE:
            return Decision(APPLIED_STATE, fix)
    ready = [fix for fix, state in states if state == NOT_APPLIED_STATE]
    if len(ready) == 1:
        return Decision(NOT_APPLIED_STATE, ready[0])
    return Decision(DRIFTED_STATE, None)


def rewrite(lines: Sequence[str], fix: Fix, *, revert: bool = False) -> str:
    """The file's text with every hunk swapped: release -> fixed, or back with revert."""
    pairs = [(h.after, h.before) if revert else (h.before, h.after) for h in fix.hunks]
    starts = locate_blocks(lines, [old for old, _ in pairs])
    assert starts is not None, "rewrite() needs a file the fix matches"
    result = list(lines)
    for start, (old, new) in reversed(list(zip(starts, pairs))):
        result[start : start + len(old)] = new
    return "".join(result)


def closest_difference(lines: Sequence[str], fixes: Sequence[Fix]) -> str:
    """Where the file parts from the release text the diffs expect, for the drift message."""
    import difflib

    for fix in fixes:
        patched = [locate_blocks(lines, [hunk.after]) is not None for hunk in fix.hunks]
        pristine = [locate_blocks(lines, [hunk.before]) is not None for hunk in fix.hunks]
        if all(p or r for p, r in zip(patched, pristine)):
            done = ", ".join(str(n) for n, p in enumerate(patched, 1) if p)
            return f"half-applied: {fix.name} hunk {done} is in place, the rest is not (a patch tool stopped half-way?)"
    best = None  # (share of the block's lines in place, fix, hunk number, block, offset)
    for fix in fixes:
        for number, hunk in enumerate(fix.hunks, 1):
            for block in (hunk.before, hunk.after):
                if locate_blocks(lines, [block]) is not None:
                    continue
                # Lines in place per alignment; the best alignment is where the block was meant to stand.
                in_place: dict[int, int] = {}
                matcher = difflib.SequenceMatcher(None, lines, block, autojunk=False)
                for a, b, size in matcher.get_matching_blocks():
                    in_place[a - b] = in_place.get(a - b, 0) + size
                offset, count = max(in_place.items(), key=lambda item: item[1])
                if best is None or count / len(block) > best[0]:
                    best = (count / len(block), fix, number, block, offset)
    if best is None:
        return "each hunk stands more than once or out of order"
    _, fix, number, block, offset = best
    for i, expected in enumerate(block):
        at = offset + i
        found = lines[at] if 0 <= at < len(lines) else "(end of file)"
        if found != expected:
            return (
                f"closest: {fix.name} hunk {number}, line {at + 1}:\n"
                f"    expected: {expected.rstrip()!r}\n"
                f"    found:    {found.rstrip()!r}"
            )
    return f"closest: {fix.name} hunk {number} stands more than once or out of order"


def drift_reason(data: bytes, text: str | None, fixes: Sequence[Fix]) -> str:
    if not data:
        return "the file is empty"
    if text is None:
        return "the file is not UTF-8 text"
    if "\r\n" in text:
        return "the file has CRLF line endings; vLLM releases use LF"
    return closest_difference(split_lines(text), fixes)


# --- write ------------------------------------------------------------------------


def read_target(path: str) -> tuple[bytes, str | None]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Failure(CANNOT_READ_OR_WRITE, f"cannot read {path}: {e.strerror}") from None
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError:
        return data, None


def leftover_temp_files(directory: str) -> list[str]:
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return []


class DirectoryLock:
    """Serializes writers. The lock is on the directory: a lock on the file would
    be lost when os.replace swaps the file, and a lock file would be left beside it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __enter__(self) -> None:
        import fcntl

        try:
            self.fd = os.open(self.directory, os.O_RDONLY)
        except OSError as e:
            raise Failure(CANNOT_READ_OR_WRITE, f"cannot open {self.directory}: {e.strerror}") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)  # releases the lock


def replace_file(path: str, text: str) -> None:
    """Swap in the new text all at once, with the old file's mode and owner."""
    import stat
    import tempfile
    from contextlib import suppress

    directory = os.path.dirname(path)
    old = os.stat(path)
    try:
        fd, temp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=".tmp")
    except OSError as e:
        raise Failure(
            CANNOT_READ_OR_WRITE,
            f"cannot write in {directory}: {e.strerror}; run as the owner of the vLLM install",
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))
            if os.geteuid() == 0:
                os.fchown(f.fileno(), old.st_uid, old.st_gid)
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as e:
        with suppress(OSError):
            os.unlink(temp)
        if isinstance(e, OSError):
            raise Failure(CANNOT_READ_OR_WRITE, f"cannot write {path}: {e.strerror}") from None
        raise
    with suppress(OSError):  # make the rename durable; the swap itself is already done
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def remove_bytecode(paths: Sequence[str]) -> None:
    """Drop cached bytecode, whatever Python wrote it: an unchecked-hash .pyc
    would go on running the old code."""
    import importlib.util
    from contextlib import suppress

    stale = set()
    for path in paths:
        for level in ("", 1, 2):
            stale.add(importlib.util.cache_from_source(path, optimization=level))
        cache_dir = os.path.join(os.path.dirname(path), "__pycache__")
        stem = os.path.splitext(os.path.basename(path))[0] + "."
        try:
            stale.update(
                os.path.join(cache_dir, n) for n in os.listdir(cache_dir) if n.startswith(stem) and n.endswith(".pyc")
            )
        except OSError:
            pass
    for pyc in stale:
        with suppress(OSError):
            os.unlink(pyc)


# --- main ---------------------------------------------------------------------------


# What a run found and did: exit code, state, action (none, applied, reverted,
# would-apply), the message, the diff used, and the file's bytes before and after.
Report = namedtuple("Report", "code state action message diff before after", defaults=(None, None, None))


def run_change(path: str, fixes: Sequence[Fix], *, revert: bool) -> Report:
    real = os.path.realpath(path)  # a symlink stays a link; the file behind it changes
    directory = os.path.dirname(real)
    data, text = read_target(real)
    decision = decide(text, fixes)
    wanted = NOT_APPLIED_STATE if revert else APPLIED_STATE
    if decision.state == wanted and not leftover_temp_files(directory):
        return settled(decision, revert, data)
    if decision.state == DRIFTED_STATE:
        return drifted(path, data, text, fixes)
    from contextlib import suppress

    with DirectoryLock(directory):
        for temp in leftover_temp_files(directory):  # from a run that was killed
            with suppress(OSError):
                os.unlink(temp)
        data, text = read_target(real)  # another run may have finished meanwhile
        decision = decide(text, fixes)
        if decision.state == wanted:
            return settled(decision, revert, data)
        if decision.state == DRIFTED_STATE:
            return drifted(path, data, text, fixes)
        assert text is not None and decision.fix is not None
        new_text = rewrite(split_lines(text), decision.fix, revert=revert)
        try:
            compile(new_text, real, "exec")
        except SyntaxError as e:
            raise Failure(BAD_BUNDLE, f"patches/{decision.fix.name} gives a file that does not compile: {e}") from None
        replace_file(real, new_text)
        remove_bytecode(sorted({path, real}))
        written, written_text = read_target(real)
        if decide(written_text, fixes).state != wanted:
            raise Failure(CANNOT_READ_OR_WRITE, f"{real} changed while it was written; run again")
    action = "reverted" if revert else "applied"
    version = installed_version(path) or "version unknown"
    message = f"{action} patches/{decision.fix.name} (vllm {version})"
    return Report(OK, wanted, action, message, decision.fix.name, data, written)


def settled(decision: Decision, revert: bool, data: bytes) -> Report:
    if revert:
        return Report(OK, NOT_APPLIED_STATE, "none", "not applied; nothing to revert", None, data, data)
    return Report(OK, APPLIED_STATE, "none", f"already applied (patches/{decision.fix.name})", decision.fix.name, data, data)


def drifted(path: str, data: bytes, text: str | None, fixes: Sequence[Fix]) -> Report:
    import hashlib

    tried = ", ".join(fix.name for fix in fixes)
    message = (
        f"source drifted: {path} matches none of the bundle's diffs; nothing was written\n"
        f"  sha256 {hashlib.sha256(data).hexdigest()}, vllm {installed_version(path) or 'version unknown'}\n"
        f"  tried: {tried}\n"
        f"  {drift_reason(data, text, fixes)}\n"
        "  next: reinstall the vllm release (pip install --force-reinstall --no-deps vllm==VERSION),"
        " or add a diff for it (README: Adding a release)"
    )
    return Report(DRIFTED, DRIFTED_STATE, "none", message, None, data, data)


def run_check(path: str, fixes: Sequence[Fix], *, show_diff: bool) -> Report:
    data, text = read_target(path)
    decision = decide(text, fixes)
    if decision.state == DRIFTED_STATE:
        return drifted(path, data, text, fixes)
    name = decision.fix.name
    if decision.state == APPLIED_STATE:
        return Report(OK, APPLIED_STATE, "none", f"applied (patches/{name})", name, data, data)
    if not show_diff:
        return Report(NOT_APPLIED, NOT_APPLIED_STATE, "none", f"not applied (patches/{name} fits)", name, data, data)
    import difflib

    lines = split_lines(text)
    new_text = rewrite(lines, decision.fix)
    change = "".join(difflib.unified_diff(lines, split_lines(new_text), f"a/{TARGET}", f"b/{TARGET}"))
    return Report(OK, NOT_APPLIED_STATE, "would-apply", change, name, data, new_text.encode("utf-8"))


class UsageError(Exception):
    pass


# Parsed by hand: argparse costs more than the rest of a --check run (~7 ms of
# imports and gettext look-ups), and its usage errors exit 2, which means drifted.
MODES = {"--check": "check", "--revert": "revert", "--diff": "diff", "--dry-run": "diff", "--verify": "verify"}
Options = namedtuple("Options", "root mode json help")


def parse_args(argv: Sequence[str]) -> Options:
    root, mode, as_json, show_help = os.environ.get("GAUDI_FIXES_ROOT") or None, "apply", False, False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            show_help = True
        elif arg == "--root" or arg.startswith("--root="):
            root = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not root or root.startswith("-"):
                raise UsageError("--root needs a directory")
        elif arg in MODES:
            if mode not in ("apply", MODES[arg]):
                raise UsageError(f"{arg} cannot go with --{mode}: choose one mode")
            mode = MODES[arg]
        elif arg == "--json":
            as_json = True
        else:
            raise UsageError(f"unknown argument {arg!r}")
    return Options(root, mode, as_json, show_help)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"apply.py: usage error: {e} (see --help)", file=sys.stderr)
        return USAGE
    if args.help:
        print(__doc__.strip())
        return OK
    path = None
    try:
        path = locate_target(args.root)
        if args.mode == "verify":
            import verify  # beside apply.py; it alone starts a process that imports vLLM

            code, lines = verify.run(path, args.root)
            states = {OK: "fails-fast", VERIFY_NOT_FAIL_FAST: "not-fail-fast", VERIFY_CANNOT_IMPORT: "cannot-import"}
            report = Report(code, states[code], "verify", lines)
        else:
            fixes = read_bundle()
            if args.mode in ("check", "diff"):
                report = run_check(path, fixes, show_diff=args.mode == "diff")
            else:
                report = run_change(path, fixes, revert=args.mode == "revert")
    except Failure as e:
        report = Report(e.code, "error", "none", str(e))
    except KeyboardInterrupt:
        return 130
    if args.json:
        print_json(report, path)
    elif report.action == "verify":
        print(report.message)
    elif report.code in (OK, NOT_APPLIED) and report.state != "error":
        print(report.message if report.action == "would-apply" else f"{report.message}: {path}")
    else:
        print(f"apply.py: {report.message}", file=sys.stderr)
    return report.code


def print_json(report: Report, path: str | None) -> None:
    import hashlib
    import json

    def digest(data: bytes | None) -> str | None:
        return None if data is None else hashlib.sha256(data).hexdigest()

    print(json.dumps({
        "state": report.state,
        "action": report.action,
        "path": path,
        "version": installed_version(path) if path else None,
        "diff": report.diff,
        "sha256_before": digest(report.before),
        "sha256_after": digest(report.after),
        "message": report.message,
        "exit_code": report.code,
    }))


if __name__ == "__main__":
    raise SystemExit(main())
