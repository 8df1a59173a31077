"""A file that no diff fits, judged by what its worker loop does with a failure (the loop
probe, on the whole matrix): a loop that already fails fast, or where every rank replies
its failure, needs nothing."""
from __future__ import annotations

import os
from collections.abc import Sequence

from .bindings import loop_reach, rebinding_of
from .bundle import LOOP_TEST, Fix
from .bytecode import stale_bytecode_files
from .disk import DirectoryLock, remove_files
from .match import find_block, fingerprint, split_lines
from .outcome import FAILS_FAST_STATE, NOT_AFFECTED_STATE, NOT_APPLIED, NOT_APPLIED_STATE, OK, STALE_BYTECODE, Report
from .proof import EXITS, REPLIES, loop_behaviour, undriven_reads, undriven_words
from .reports import drifted

MESSAGES = {
    EXITS: (FAILS_FAST_STATE, "already fails fast: a rank that fails a call it does not answer exits, by this file's"
                              " own code (no diff of this bundle); nothing to do"),
    REPLIES: (NOT_AFFECTED_STATE, "not affected: every rank answers every call and replies its own failure; nothing to do"),
}


def by_behaviour(path: str, data: bytes, text: str | None, fixes: Sequence[Fix], pycache_prefix: str | None, *,
                 check: bool = True) -> Report | None:
    """For a file that no diff fits and that holds none of their fixed text: what its
    worker loop does with a failure, driven as the bundle's loop test drives it, in a
    child, on the whole matrix (loop_probe.cases.behaviour). A loop that already ends a failing
    non-output rank (upstream's fix once it lands, a vendor's) or where every rank
    answers every call and replies its failure (0.6.5-0.8.4) needs nothing: exit 0, with
    its own state, once nothing else runs in its place (no rebinding of the loop, no
    stale bytecode; apply removes that, --check says 1). None otherwise (the bug, or a
    loop the probe cannot drive), or a drift report that says why the file's loop is not
    what runs."""
    if text is None or not os.path.isfile(LOOP_TEST):
        return None
    again = other_code_runs(text, fixes)
    if again == "":
        return None
    if again:
        return drifted(path, data, text, fixes, reason=f"its loop is judged by what it does, but {again}")
    found = MESSAGES.get(loop_behaviour(path))
    if found is None:
        return None
    unproven = not_judged_by_one_loop(text)
    if unproven:
        return drifted(path, data, text, fixes, reason=f"its loop reads {found[0]} on one node, but {unproven}")
    state, message = found
    sources = sorted({path, os.path.realpath(path)})
    stale = stale_bytecode_files(sources, data, pycache_prefix)
    if stale and check:
        message = f"{STALE_BYTECODE}{stale[0]} would run instead of this file, which is {state} (apply.py removes it)"
        return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=message, before=data, after=data)
    if stale:
        with DirectoryLock(os.path.dirname(os.path.realpath(path))):
            kept = remove_files(stale_bytecode_files(sources, data, pycache_prefix))
        if kept:
            pyc, reason = next(iter(kept.items()))
            message = (
                f"nothing to do to the file ({state}), but stale bytecode {pyc} cannot be removed ({reason}) and"
                f" would run instead of it: remove it as its owner (rm {pyc}), then run again"
            )
            return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=message, before=data, after=data)
        message += f", removed stale bytecode {', '.join(stale)}"
    return Report(code=OK, state=state, message=message, before=data, after=data)


def not_judged_by_one_loop(text: str) -> str | None:
    """Why what the file's loop does on one node does not prove it, or None."""
    from .loop_probe.extract import runs_across_nodes

    if runs_across_nodes(text):
        # A worker that exits on its own node ends the engine there; a worker on another
        # node must end it too, through the executor, which the probe does not run.
        return ("its executor runs across nodes (peer_worker_response_mqs), where a failing rank's exit must also"
                " end the engine: the behaviour probe drives one node's loop only, so it cannot judge this file")
    undriven = undriven_reads(text)
    return undriven_words(undriven) if undriven else None


def other_code_runs(text: str, fixes: Sequence[Fix]) -> str | None:
    """None if the file's loop may be judged by what it does; "" if it may not (part of
    this bundle's fix stands, a release's functions stand, or it does not parse); else
    where the module binds the loop again, so that another loop runs."""
    import ast

    lines = split_lines(text)
    if any(find_block(lines, hunk.after) for fix in fixes for hunk in fix.hunks):
        return ""  # part of this bundle's fix: half-applied, or edited after
    if any(fingerprint(lines, fix) for fix in fixes):
        return ""  # a release's functions, drifted by what else binds or runs: drift_reason says
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    return rebinding_of(module, loop_reach(module) | {"worker_busy_loop"})
