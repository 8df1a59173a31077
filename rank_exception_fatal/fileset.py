"""The fix as the set of its files (docs/supervisor.md §3): the executor, decided as the
gate and apply decide it alone, and the rest (exit_path): the helper, the API server's
launcher and server file, and the message queue. Checked, applied, reverted and diffed together: 0 only when every file is
applied; apply writes the helper, launcher and server file first and the executor last,
revert the reverse; a drift in any file writes nothing."""
import os

from .exit_path import HELPER, Part, read_exit_path, still_as_decided, to_write, write_exit_path
from .outcome import (APPLIED, APPLIED_STATE, DRIFTED, DRIFTED_STATE, NOT_AFFECTED_STATE, NOT_APPLIED,
                      NOT_APPLIED_STATE, OK, REVERTED, STALE_BYTECODE, TARGET, WOULD_APPLY, FileReport, Report)

# What to do when the exit path drifted (a vendor's launcher, a release newer than the table).
DRIFT_NEXT = ("  next: put back the release's files (pip install --force-reinstall --no-deps NAME==VERSION), or {what}"
              " the executor's fix alone with apply.py {args}")
APPLY_ALONE = ("apply", "--executor-only (vllm serve then exits 0 when it ends the engine: README, Restart)")
REVERT_ALONE = ("revert", "--revert --executor-only")


def tree_of(path: str) -> str:
    """The directory holding vllm/, from the executor's path."""
    return path[: -len(TARGET) - 1]


def diffs_of(parts: list[Part]) -> str:
    return ", ".join(f"patches/{part.diff}{' adapted' if part.adapted else ''}" for part in parts)


def roles_of(parts: list[Part]) -> str:
    return ", ".join(part.role for part in parts)


def set_report(path: str, executor: Report, parts: list[Part], *, revert: bool = False,
               written: "list[Part] | None" = None, before: "list[Part] | None" = None) -> Report:
    """The set's Report, from the executor's and the exit path's files: drift if any file
    drifted; else the executor's error; else not applied while any file is not (naming
    them); else the executor's. With each file's FileReport."""
    drifts = [part.why for part in parts if part.state == DRIFTED_STATE]
    if executor.code == DRIFTED or drifts:
        message = executor.message if executor.code == DRIFTED else "source drifted: the exit path; nothing was written"
        what, args = REVERT_ALONE if revert else APPLY_ALONE
        message += "".join(f"\n  exit path: {why}" for why in drifts)
        message += f"\n{DRIFT_NEXT.format(what=what, args=args)}" if drifts else ""
        report = executor.replaced(code=DRIFTED, state=DRIFTED_STATE, message=message)
    elif executor.code not in (OK, NOT_APPLIED):
        return executor
    else:
        wanted = NOT_APPLIED_STATE if revert else APPLIED_STATE
        remaining = [part for part in parts if part.state != wanted]
        if written:
            words = f"the exit path: {'took back' if revert else 'wrote'} {roles_of(written)}"
        elif not remaining:
            words = f"the exit path {'not applied' if revert else 'applied'}"
        else:
            words = (f"the exit path's {roles_of(remaining)} {'remain' if len(remaining) > 1 else 'remains'} to"
                     f" {'revert' if revert else 'apply'} ({diffs_of(remaining)})")
        report = executor.replaced(message=f"{executor.message}; {words}")
        if remaining and executor.code == OK:
            state = APPLIED_STATE if revert else NOT_APPLIED_STATE
            report = report.replaced(code=NOT_APPLIED, state=state,
                                     message=f"not {'reverted' if revert else 'applied'}: {words}; the executor: {executor.message}")
        if written:
            report = report.replaced(action=REVERTED if revert else APPLIED)
    return report.replaced(files=file_reports(path, executor, parts, before or parts))


def check_set(path: str, pycache_prefix: "str | None", *, exact: bool) -> Report:
    """--check: the set's Report (the gate)."""
    return decide_set(path, pycache_prefix, exact=exact, plan=False)[0]


def decide_set(path: str, pycache_prefix: "str | None", *, exact: bool, plan: bool,
               revert: bool = False) -> "tuple[Report, Report, list[Part]]":
    """(the set's Report, the executor's, the exit path's files), each file decided; revert:
    for a revert (what a drift then tells to do)."""
    from .check import run_check

    executor = run_check(path, pycache_prefix, exact=exact)
    if executor.code not in (OK, NOT_APPLIED, DRIFTED):
        return executor, executor, []
    parts = read_exit_path(tree_of(path), plan=plan, exact=exact)
    if executor.state == NOT_AFFECTED_STATE:  # a release without the bug: no fix fires, so no exit to carry
        return executor.replaced(files=file_reports(path, executor, parts, parts)), executor, parts
    report = set_report(path, executor, parts, revert=revert)
    if report.code == OK and not revert:  # a .pyc of the release's code would run in place of a fixed file
        from .exit_path import stale_bytecode_of

        stale = [(part, pyc) for part in parts for pyc in stale_bytecode_of(tree_of(path), part.path, part.data,
                                                                            pycache_prefix) if part.data is not None]
        if stale:
            part, pyc = stale[0]
            report = report.replaced(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=(
                f"{STALE_BYTECODE}{pyc} would run instead of the fixed {part.role} (patches/{part.diff}; apply.py"
                f" removes it); {report.message}"))
    return report, executor, parts


def change_set(path: str, fixes, pycache_prefix: "str | None", *, revert: bool, exact: bool) -> Report:
    """Apply: the exit path's files, then the executor. Revert: the executor, then the exit
    path's files. Every file decided, the executor's new bytes planned (and proven, where
    the table does not know it), and every write checked possible, before any is written;
    under one lock on vllm/ (the executor's own, on its directory, inside it)."""
    from .change import run_change
    from .disk import DirectoryLock, check_writable

    tree = tree_of(path)
    with DirectoryLock(os.path.join(tree, "vllm")):
        gate, executor, parts = decide_set(path, pycache_prefix, exact=exact, plan=True, revert=revert)
        if gate.code not in (OK, NOT_APPLIED) or (gate.state == NOT_AFFECTED_STATE and not revert):
            return gate
        # The executor is written last: its plan and its write checked first, where apply writes its source
        # (not where it only removes stale bytecode).
        writes_executor = (not revert and executor.state == NOT_APPLIED_STATE
                           and not executor.message.startswith(STALE_BYTECODE))
        planned = None
        if writes_executor:
            planned = executor_planned(path, fixes, exact)
            if isinstance(planned, Report):
                return set_report(path, planned, parts)
        record = record_change(path, parts, revert)
        writable_or_refused(tree, parts, revert, [(path, TARGET, None)] if writes_executor else [])
        if record:
            check_writable(record[0])
        if revert:
            still_as_decided(tree, parts)  # before the executor is taken back, as apply checks before its first write
            executor = run_change(path, fixes, pycache_prefix, revert=True, exact=exact)
            if executor.code != OK:
                return set_report(path, executor, parts, revert=True)
            after, kept = exit_path_reverted(tree, parts, pycache_prefix)
        else:
            # The row first: a run cut short then leaves a row without its file, which pip's uninstall skips,
            # never the module without its row.
            if record:
                still_as_decided(tree, parts)
                record_written(*record)
            after, kept = write_exit_path(tree, parts, revert=False, pycache_prefix=pycache_prefix)
            executor = executor_written(path, fixes, pycache_prefix, exact, parts, after, planned)
        if record and revert:
            record_written(*record)
    written = [new for old, new in zip(parts, after) if old.data != new.data]
    report = set_report(path, executor, after, revert=revert, written=written, before=parts)
    if record and report.code in (OK, NOT_APPLIED):
        report = report.replaced(message=f"{report.message}; {'took' if revert else 'listed'} {HELPER}"
                                         f" {'out of' if revert else 'in'} {record[0]} for pip's uninstall")
    if kept and report.code == OK:
        pyc, why = next(iter(kept.items()))
        report = report.replaced(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=(
            f"{report.message}; but {STALE_BYTECODE}{pyc} stays ({why}), and Python would run it: remove it as its"
            " owner, or run again as root"))
    return report


def record_change(path: str, parts: list[Part], revert: bool) -> "tuple[str, bytes, bytes] | None":
    """(the owning wheel's RECORD, its bytes, its new bytes) where it does not list the
    helper as the run leaves it (a row while the module exists, none once it is removed,
    so that `pip uninstall` removes what apply created); None where it does, or where no
    RECORD is."""
    from .installed import owning_record, record_with

    record = owning_record(path)
    if record is None:
        return None
    try:
        with open(record, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # not a RECORD pip could read either: left as it is
    helper = next(part for part in parts if part.role == "helper")
    new = record_with(text, HELPER, None if revert else helper.fixed).encode("utf-8")
    return None if new == data else (record, data, new)


def record_written(record: str, old: bytes, new: bytes) -> None:
    """RECORD replaced by new, unless another program (pip) changed it since it was read:
    then exit 9, its bytes kept."""
    from .disk import replace_file
    from .exit_path import read_file
    from .outcome import CHANGED_AFTER_WRITE, Failure

    if read_file(record) != old:
        raise Failure(CHANGED_AFTER_WRITE, f"{record} changed while apply.py ran: another program writes the"
                                           " install; run again")
    replace_file(record, new)


def executor_planned(path: str, fixes, exact: bool) -> "tuple[bytes, bytes] | Report":
    """(the executor's bytes, the new bytes planned for them: decided again, compiled,
    proven by the loop test where the table does not know the file), or the drift Report
    if there are none. Asked before the exit path is written: after, it would be a drift
    with files written."""
    from .change import plan, read_and_decide

    read = read_and_decide(path, fixes, exact)
    new = plan(read, revert=False, exact=exact)
    return (read.data, new) if isinstance(new, bytes) else new


def executor_written(path: str, fixes, pycache_prefix: "str | None", exact: bool, before: list[Part],
                     after: list[Part], planned: "tuple[bytes, bytes] | None") -> Report:
    """The executor applied, last; a Failure then (a full disk, another writer) says that the
    exit path is already written, which the next run completes and --revert takes back."""
    from .change import run_change
    from .outcome import Failure

    try:
        return run_change(path, fixes, pycache_prefix, revert=False, exact=exact, planned=planned)
    except Failure as e:
        written = [part.role for old, part in zip(before, after) if old.data != part.data]
        done = f"; the exit path was written first ({', '.join(written)}): run apply.py again" if written else ""
        raise Failure(e.code, f"{e}{done}") from None


def exit_path_reverted(tree: str, parts: list[Part], pycache_prefix: "str | None") -> "tuple[list[Part], dict[str, str]]":
    """The exit path taken back, after the executor; a Failure then says that the executor
    is reverted already, which the next --revert completes."""
    from .outcome import Failure

    try:
        return write_exit_path(tree, parts, revert=True, pycache_prefix=pycache_prefix)
    except Failure as e:
        raise Failure(e.code, f"{e}; the executor was reverted first: run apply.py --revert again") from None


def writable_or_refused(tree: str, parts: list[Part], revert: bool, first: "list[tuple]" = ()) -> None:
    """Exit 4 before anything is written if a file to write (to create, or to remove: the
    helper) could not be written (its directory, its owner), or is a link out of the tree
    that other environments may share. first: (path, its path in the tree, None) to check
    before the exit path's files."""
    from .disk import check_writable, refuse_a_shared_file
    from .exit_path import created_like

    files = [*first, *((os.path.join(tree, part.path), part.path, None if part.data is not None else
                        created_like(tree, parts)) for part in to_write(parts, revert=revert))]
    for file, relative, like in files:
        refuse_a_shared_file(file, relative)
        check_writable(os.path.realpath(file), like)  # the write goes through a link within the tree


def diff_set(path: str, fixes, *, exact: bool) -> Report:
    """--diff: what apply would write to the set's files, in its order, as one patch."""
    import difflib

    from .change import run_diff
    from .match import split_lines

    executor = run_diff(path, fixes, exact=exact)
    if executor.code not in (OK, DRIFTED):
        return executor
    parts = read_exit_path(tree_of(path), exact=exact)
    if executor.code == DRIFTED or any(part.state == DRIFTED_STATE for part in parts):
        return set_report(path, executor, parts)
    writable_or_refused(tree_of(path), parts, False)  # as the real run would refuse: a diff it cannot write misleads
    changes = []
    for part in to_write(parts, revert=False):
        old = split_lines(part.data.decode("utf-8")) if part.data is not None else []
        source = "/dev/null" if part.data is None else f"a/{part.path}"
        changes.append("".join(difflib.unified_diff(old, split_lines(part.fixed.decode("utf-8")), source,
                                                    f"b/{part.path}")))
    if executor.action == WOULD_APPLY:
        changes.append(executor.message)
    if not changes:
        return set_report(path, executor, parts)
    would_be = [Part(part.role, part.path, part.fixed, APPLIED_STATE, diff=part.diff, adapted=part.adapted)
                for part in parts]
    return executor.replaced(state=NOT_APPLIED_STATE, action=WOULD_APPLY, message="".join(changes),
                             files=file_reports(path, executor, would_be, parts))


def running_set(pid: str, report: Report) -> Report:
    """--check --pid on an applied set: 0 only if the process started after each file last changed."""
    from .running import as_running

    for file in [entry.path for entry in report.files if entry.after is not None]:
        report = as_running(pid, file, report, what="the fix")
        if report.code != OK:
            break
    return report


def seen_alike_by(pid: str, path: str) -> None:
    """Exit 12 if process pid, in another mount namespace (a container), sees other files
    (or none) at the exit path's paths than here, or at their directories."""
    from .locate import sees_the_same_files

    try:
        elsewhere = os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return  # as locate_for_process read it: the same namespace
    if elsewhere:
        tree = tree_of(path)
        files = [os.path.join(tree, part.path) for part in read_exit_path(tree, plan=False)]
        sees_the_same_files(pid, [*files, *{os.path.dirname(file) for file in files}])


def file_reports(path: str, executor: Report, parts: list[Part], before: list[Part]) -> list[FileReport]:
    """Report.files: the executor at path (as its own Report has it), then each exit path file."""
    tree = tree_of(path)
    return [FileReport("executor", path, executor.state, executor.diff, executor.adapted, executor.before,
                       executor.after),
            *(FileReport(part.role, os.path.join(tree, part.path), part.state, part.diff, part.adapted, old.data,
                         part.data) for old, part in zip(before, parts))]
