"""The Reports that runs end with, in the operator's words: settled, drifted, or the file
right but stale bytecode in its place."""
from __future__ import annotations

from collections.abc import Sequence

from .adapt import adapted_words
from .bundle import Fix
from .drift import drift_reason
from .installed import describe, fork_note, how_to_restore, installed_distribution
from .outcome import (APPLIED_STATE, DRIFTED, DRIFTED_STATE, NO_ACTION, NOT_APPLIED, NOT_APPLIED_STATE, OK, Decision,
                      Report)
from .seal import sha256_hex


def settled(decision: Decision, revert: bool, data: bytes, removed: Sequence[str], adaptation=None) -> Report:
    """Exit 0: the file already is as wanted (once stale bytecode was removed)."""
    cleaned = f", removed stale bytecode {', '.join(removed)}" if removed else ""
    if revert:
        return Report(code=OK, state=NOT_APPLIED_STATE, message=f"not applied (nothing to revert{cleaned})",
                      before=data, after=data)
    how = f"; {adapted_words(adaptation)}" if adaptation else ""
    return Report(code=OK, state=APPLIED_STATE, message=f"already applied (patches/{decision.fix.name}{how}{cleaned})",
                  diff=decision.fix.name, before=data, after=data, adapted=adaptation is not None)


def bytecode_kept(decision: Decision, revert: bool, action: str, before: bytes, after: bytes,
                  kept: dict[str, str]) -> Report:
    """Exit 1: the file is as wanted, but Python would run the other side's code from a .pyc."""
    pyc, reason = next(iter(kept.items()))
    done = f"{action} patches/{decision.fix.name}" if action != NO_ACTION else "nothing to do to the file"
    message = (
        f"{done}, but stale bytecode {pyc} cannot be removed ({reason}) and would run instead of the file:"
        f" remove it as its owner (rm {pyc}), then run again"
    )
    state = APPLIED_STATE if revert else NOT_APPLIED_STATE  # what would run
    return Report(code=NOT_APPLIED, state=state, message=message, action=action, diff=decision.fix.name,
                  before=before, after=after)


def drifted(path: str, data: bytes, text: str | None, fixes: Sequence[Fix], reason: str | None = None) -> Report:
    """Exit 2: what the file is, which diffs were tried, where it parts from the nearest,
    and what to do next."""
    distribution = installed_distribution(path)
    message = (
        f"source drifted: {path} matches none of the bundle's diffs; nothing was written\n"
        f"  sha256 {sha256_hex(data)}, {describe(distribution)}\n"
        f"  tried: {', '.join(fix.name for fix in fixes)}\n"
        f"  {reason or drift_reason(data, text, fixes)}\n"
        f"  next: {how_to_restore(distribution, path)}, or add a diff for it (docs/releases.md: Adding a release)"
        + fork_note(distribution)
    )
    return Report(code=DRIFTED, state=DRIFTED_STATE, message=message, before=data, after=data)
