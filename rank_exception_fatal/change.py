"""Apply and revert, and --diff, their dry run: each plans the new bytes first (decided,
rewritten, decided again, compiled, proven when adapted), on one path; apply and revert
then write them under the directory's lock."""
from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Sequence

from .adapt import adapted_words
from .bytecode import bytecode_files, stale_bytecode_files
from .decide import decide, decide_any
from .disk import (DirectoryLock, check_writable, compile_error, leftover_temp_files, refuse_a_shared_file,
                   remove_files, replace_file)
from .earlier import decide_file
from .installed import container_note, describe, installed_distribution
from .judged import by_behaviour
from .locate import read_target
from .match import rewrite, split_lines
from .outcome import (APPLIED, APPLIED_STATE, BAD_BUNDLE, CHANGED_AFTER_WRITE, DRIFTED_STATE, ERROR_STATE, NO_ACTION,
                      NOT_APPLIED, NOT_APPLIED_STATE, OK, REVERTED, TARGET, WOULD_APPLY, Failure, Report)
from .proof import known_file, prove, unproven
from .reports import bytecode_kept, drifted, settled
from .running import mark_changed

# The file as read, and what was decided of it: path (as given), its bytes and text,
# the Decision, the Adaptation (None: the diff fits exactly), the fixes tried, and the
# EarlierFix row (or AdaptedEarlier) if an earlier bundle's diff made it (then text is the text it was made on,
# which that diff taken back gives, and the Decision is of that text).
Read = namedtuple("Read", "path data text decision adaptation fixes earlier")


def read_and_decide(path: str, fixes: Sequence, exact: bool) -> Read:
    data, text = read_target(os.path.realpath(path))
    earlier, text, decision, adaptation = decide_file(data, text, fixes, exact=exact)
    return Read(path, data, text, decision, adaptation, fixes, earlier)


def plan(read: Read, *, revert: bool, exact: bool) -> bytes | Report:
    """The new bytes for a file the decision fits (not yet on the wanted side), or the
    drift Report that says why there are none: rewritten, decided again (it must read as
    the wanted side of the same diff), compiled, and proven by the loop test if adapted."""
    path, data, released, decision, adaptation, fixes, earlier = read
    real = os.path.realpath(path)
    wanted = NOT_APPLIED_STATE if revert else APPLIED_STATE
    if earlier is not None and revert:
        new = released.encode("utf-8")  # the release's, which the earlier diff taken back gave
    else:
        new = rewrite(split_lines(released), decision.fix, revert=revert).encode("utf-8")
    text = data.decode("utf-8") if earlier is not None else released  # what a drift report shows: the file
    again, _ = decide_any(new.decode("utf-8"), fixes, exact=exact)
    if (again.state, again.fix and again.fix.name) != (wanted, decision.fix.name):
        return drifted(path, data, text, fixes)
    error = compile_error(new, real)
    if error is not None:
        if compile_error(data, real) is not None:
            return drifted(path, data, text, fixes, reason=f"the file does not compile as it stands: {error}")
        if adaptation is not None:
            return drifted(path, data, text, fixes, reason=f"{adapted_words(adaptation)}; but the result does not compile: {error}")
        raise Failure(BAD_BUNDLE, f"patches/{decision.fix.name} gives a file that does not compile: {error}")
    if not revert and (adaptation is not None or not known_file(released.encode("utf-8"))):
        failure = prove(new, real)  # a build's, or a vendor's: the diff's functions are not all it reads
        if failure is not None:
            how = f"could be {adapted_words(adaptation)}" if adaptation is not None else "fits"
            return drifted(path, data, text, fixes, reason=f"patches/{decision.fix.name} {how}; but {failure}")
    return new


def run_diff(path: str, fixes: Sequence, *, exact: bool = False) -> Report:
    """--diff (--dry-run): the change the real run would write, as a unified diff; nothing
    is written. Refused as the real run would refuse it."""
    import difflib

    read = read_and_decide(path, fixes, exact)
    data, text, decision, adaptation = read.data, read.text, read.decision, read.adaptation
    if decision.state == DRIFTED_STATE:
        return drifted(path, data, text, fixes)
    name, adapted = decision.fix.name, adaptation is not None
    how = f"; {adapted_words(adaptation)}" if adapted else ""
    if decision.state == APPLIED_STATE and read.earlier is None:
        return not_proven(read) or Report(code=OK, state=APPLIED_STATE, message=f"applied (patches/{name}{how})",
                                          diff=name, before=data, after=data, adapted=adapted)
    refuse_a_shared_file(path)  # what the real run would need: a diff it cannot write misleads
    check_writable(os.path.realpath(path))
    new = plan(read, revert=False, exact=exact)
    if not isinstance(new, bytes):
        return new
    old = split_lines(data.decode("utf-8"))  # the file as it stands (text is the release's for an earlier fix)
    change = "".join(difflib.unified_diff(old, split_lines(new.decode("utf-8")), f"a/{TARGET}", f"b/{TARGET}"))
    return Report(code=OK, state=NOT_APPLIED_STATE, message=change, action=WOULD_APPLY, diff=name, before=data,
                  after=new, adapted=adapted)


def run_change(path: str, fixes: Sequence, pycache_prefix: str | None, *, revert: bool, exact: bool = False,
               planned: tuple[bytes, bytes] | None = None) -> Report:
    """Apply (or revert) the fix: nothing to do if the file is on the wanted side already
    and no stale bytecode or left-over temporary file is about; else, under the lock,
    decided again, planned and written. planned: (the file's bytes, the new bytes plan()
    made of them) by the caller, used if the file still holds those bytes (the loop test's
    proof of an adapted fix costs seconds)."""
    real = os.path.realpath(path)  # a symlink within the tree stays a link; the file behind it changes
    directory = os.path.dirname(real)
    sources = sorted({path, real})  # Python caches bytecode by the path it imported
    read = read_and_decide(path, fixes, exact)
    wanted = NOT_APPLIED_STATE if revert else APPLIED_STATE
    if (read.decision.state == wanted and read.earlier is None and not leftover_temp_files(directory)
            and not stale_bytecode_files(sources, read.data, pycache_prefix)):
        return not_proven(read) or settled(read.decision, revert, read.data, [], read.adaptation)
    if read.decision.state == DRIFTED_STATE:
        judged = not (revert or exact) and by_behaviour(path, read.data, read.text, fixes, pycache_prefix, check=False)
        return judged or drifted(path, read.data, read.text, fixes)
    refuse_a_shared_file(path)
    with DirectoryLock(directory):
        remove_files(leftover_temp_files(directory))  # from a run that was killed
        read = read_and_decide(path, fixes, exact)  # another run may have finished meanwhile
        if read.decision.state == wanted and read.earlier is None:
            return not_proven(read) or settle(read, sources, pycache_prefix, revert)
        if read.decision.state == DRIFTED_STATE:
            return drifted(path, read.data, read.text, fixes)
        new = planned[1] if planned and planned[0] == read.data else plan(read, revert=revert, exact=exact)
        if not isinstance(new, bytes):
            return new
        return write(read, new, sources, pycache_prefix, revert)


def not_proven(read: Read) -> Report | None:
    """Drift for a fix that stands on a file the table does not know, unless the loop test
    passes on it now (as the gate asks); None otherwise."""
    if read.decision.state != APPLIED_STATE or read.earlier is not None or known_file(read.data):
        return None
    failure = unproven(read.data, os.path.realpath(read.path), read.decision, read.adaptation)
    return None if failure is None else drifted(read.path, read.data, read.text, read.fixes, reason=failure)


def settle(read: Read, sources: list[str], pycache_prefix: str | None, revert: bool) -> Report:
    """The file is on the wanted side: remove stale bytecode of the other side's code, and
    mark the file changed, so that --check --pid tells a server started before."""
    real = os.path.realpath(read.path)
    stale = stale_bytecode_files(sources, read.data, pycache_prefix)
    kept = remove_files(stale)
    unmarked = mark_changed(real) if stale else None  # a server started before runs the removed code
    if kept:
        return bytecode_kept(read.decision, revert, NO_ACTION, read.data, read.data, kept)
    if unmarked:
        # --check --pid would read 0 for a server that still runs the removed code.
        message = (
            f"removed stale bytecode {', '.join(stale)}, but cannot mark {real} changed ({unmarked}), so"
            f" --check --pid cannot tell a server started before it, which runs the removed code: run"
            f" again as the file's owner or root, or restart the server"
        )
        return Report(code=NOT_APPLIED, state=read.decision.state, message=message, diff=read.decision.fix.name,
                      before=read.data, after=read.data)
    return settled(read.decision, revert, read.data, stale, read.adaptation)


def write(read: Read, new: bytes, sources: list[str], pycache_prefix: str | None, revert: bool) -> Report:
    """Swap in the new bytes, remove every .pyc of the file, and read it back."""
    real = os.path.realpath(read.path)
    name = read.decision.fix.name
    replace_file(real, new)
    failed = remove_files(bytecode_files(sources, pycache_prefix))  # an unchecked-hash .pyc would go on running the old code
    try:
        written, written_text = read_target(real)
        state = decide(written_text, read.fixes).state
    except Failure:
        written, state = None, None
    action = REVERTED if revert else APPLIED
    if written != new:
        message = (
            f"{action} patches/{name}, but {real} then read back other bytes"
            f" ({state or 'unreadable'}): another program changed it; run again"
        )
        return Report(code=CHANGED_AFTER_WRITE, state=state or ERROR_STATE, message=message, action=action, diff=name,
                      before=read.data, after=written)
    # A cache another user owns, or a prefix on a read-only mount: the file is right,
    # but Python would run what the .pyc holds.
    kept = {pyc: failed[pyc] for pyc in stale_bytecode_files(sources, new, pycache_prefix) if pyc in failed}
    if kept:
        return bytecode_kept(read.decision, revert, action, read.data, new, kept)
    how = f"; {adapted_words(read.adaptation)}" if read.adaptation and not revert else ""
    if not revert and (read.adaptation is not None or not known_file(read.text.encode("utf-8"))):
        how += "; proven by the loop test"
    if read.earlier is None:
        what = f"patches/{name}"
    elif revert:
        what = f"patches/{read.earlier.path} (an earlier bundle's fix)"
    else:
        what = f"patches/{name} in place of an earlier bundle's fix (patches/{read.earlier.path})"
    message = f"{action} {what} ({describe(installed_distribution(read.path))}){how}"
    note = container_note(real)
    message += f"; {note}" if note else ""
    if read.earlier is not None and revert:
        name = read.earlier.path  # the diff taken back
    return Report(code=OK, state=NOT_APPLIED_STATE if revert else APPLIED_STATE, message=message, action=action,
                  diff=name, before=read.data, after=written, adapted=read.adaptation is not None)
