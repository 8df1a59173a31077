"""The decision for a file's text: which diff fits it and on which side, exactly or, for a
build between releases, adapted; or drift."""
from __future__ import annotations

from collections.abc import Sequence

from .adapt import Adaptation, adapt
from .bindings import dead_fix, rebinding
from .bundle import Fix
from .match import fingerprint, split_lines
from .outcome import BAD_BUNDLE, DRIFTED_STATE, Decision, Failure
from .proof import undriven_reads


def decide(text: str | None, fixes: Sequence[Fix]) -> Decision:
    """What to do with the file's text (None: not UTF-8, which no release is)."""
    if text is None or "\0" in text:  # no release holds a NUL, and compile() refuses one
        return Decision(DRIFTED_STATE, None)
    lines = split_lines(text)
    matches = [(fix, state) for fix in fixes for state in [fingerprint(lines, fix)] if state]
    if len(matches) > 1:
        names = " and ".join(f"patches/{fix.name}" for fix, _ in matches)
        raise Failure(BAD_BUNDLE, f"{names} both fit this file: each release must fit one diff; fix the bundle")
    if not matches:
        return Decision(DRIFTED_STATE, None)
    fix, state = matches[0]
    if rebinding(text, fix) or dead_fix(text, fix) or undriven_reads(text):
        return Decision(DRIFTED_STATE, None)
    return Decision(state, fix)


def decide_any(text: str | None, fixes: Sequence[Fix], *, exact: bool) -> tuple[Decision, Adaptation | None]:
    """decide(), and for a file no diff fits exactly (unless exact), adapt()."""
    decision = decide(text, fixes)
    if decision.state != DRIFTED_STATE or exact or text is None or "\0" in text:
        return decision, None
    adaptation = adapt(text, fixes)
    if adaptation is None:
        return decision, None
    return Decision(adaptation.state, adaptation.fix), adaptation
