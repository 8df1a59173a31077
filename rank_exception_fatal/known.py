"""Files the release table knows (a release's, or the one its diff makes), decided by
their sha256 alone: --check on a known file parses no diff."""
from __future__ import annotations

import os

from . import bundle
from .bundle import Fix, check_integrity, diff_commit, diff_names
from .outcome import APPLIED_STATE, NOT_APPLIED_STATE, Decision
from .seal import sha256_hex
from .table import read_releases


def known_files(table: str) -> dict[str, Decision]:
    """sha256 -> decision, for each release's file and the file its diff makes of it,
    from the release table's text. ValueError if the table is not whole or its rows
    contradict each other."""
    known = {}
    for release in read_releases(table).values():
        known[release.sha256] = Decision(NOT_APPLIED_STATE, Fix(release.diff, ()))
        known[release.fixed_sha256] = Decision(APPLIED_STATE, Fix(release.diff, ()))
    return known


def decide_by_hash(data: bytes) -> Decision | None:
    """The decision for a file the release table knows, without parsing a diff: parsing
    costs more than the rest of a --check together. None for any other file, and when
    patches/ is not the set of diffs the table names, and those for upstream main between
    releases (then parsing gives the reason). The answer rests on the table, which is
    sealed; of the diffs only the one it names is read, and must be whole, as apply and
    revert will use it (hashing every diff would cost a tenth of the gate)."""
    try:
        with open(bundle.TABLE, encoding="utf-8") as f:
            known = known_files(f.read())
        names = diff_names(bundle.PATCHES_DIR)
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None
    decision = known.get(sha256_hex(data))
    named = {d.fix.name for d in known.values()}
    if decision is None or not named <= set(names) or not all(diff_commit(n) for n in set(names) - named):
        return None
    name = decision.fix.name
    try:
        with open(os.path.join(bundle.PATCHES_DIR, name), encoding="utf-8", newline="") as f:
            check_integrity(name, f.read())  # exit 5 if it is not whole, as a parse would say
    except (OSError, UnicodeDecodeError):
        return None
    return decision
