"""--check, the deploy gate: 0 applied, 1 not applied, 2 drifted. A file the release table
knows is decided by its sha256 alone; any other by the diffs, adapted, or by what its
loop does."""
from __future__ import annotations

import os

from .bytecode import stale_bytecode_files
from .disk import read_target
from .known import decide_by_hash
from .outcome import APPLIED_STATE, NOT_APPLIED, NOT_APPLIED_STATE, OK, Report


def run_check(path: str, pycache_prefix: str | None, *, exact: bool = False) -> Report:
    data, text = read_target(path)
    decision = decide_by_hash(data)
    if decision is None:
        return check_by_the_diffs(path, data, text, pycache_prefix, exact=exact)
    return checked(path, data, decision, None, pycache_prefix)


def check_by_the_diffs(path: str, data: bytes, text: str | None, pycache_prefix: str | None, *, exact: bool) -> Report:
    """A file the table does not know: parsed diffs, adaptation, the loop probe. (Imported
    here: a known file, the gate's usual case, needs none of them.)"""
    from .bundle import read_bundle
    from .decide import decide_any
    from .judged import by_behaviour
    from .outcome import DRIFTED_STATE
    from .reports import drifted

    fixes = read_bundle()
    decision, adaptation = decide_any(text, fixes, exact=exact)
    if decision.state == DRIFTED_STATE:
        judged = not exact and by_behaviour(path, data, text, fixes, pycache_prefix)
        return judged or drifted(path, data, text, fixes)
    return checked(path, data, decision, adaptation, pycache_prefix)


def checked(path: str, data: bytes, decision, adaptation, pycache_prefix: str | None) -> Report:
    """0 applied (1 if stale bytecode of the release would run instead), 1 not applied."""
    name = decision.fix.name
    if decision.state == APPLIED_STATE:
        stale = stale_bytecode_files(sorted({path, os.path.realpath(path)}), data, pycache_prefix)
        if stale:
            message = (
                f"stale bytecode {stale[0]} would run instead of the fixed source (patches/{name}; apply.py removes it)"
            )
            return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=message, diff=name, before=data, after=data)
    adapted = adaptation is not None
    if adapted:
        from .adapt import adapted_words
    how = f"; {adapted_words(adaptation)}" if adapted else ""
    if decision.state == APPLIED_STATE:
        return Report(code=OK, state=APPLIED_STATE, message=f"applied (patches/{name}{how})", diff=name,
                      before=data, after=data, adapted=adapted)
    proof = "; apply.py proves it with the loop test before it writes" if adapted else ""
    return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=f"not applied (patches/{name} fits{how}{proof})",
                  diff=name, before=data, after=data, adapted=adapted)
