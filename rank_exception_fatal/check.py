"""--check, the deploy gate: 0 applied, 1 not applied, 2 drifted. A file the release table
knows (a release's, or the one its diff makes) is decided by its sha256 alone, a hash
lookup that parses no diff: the gate's usual case. Any other by the diffs, adapted, or
by what its loop does."""
import os

from . import bundle
from .bundle import Fix, check_integrity, diff_commit, diff_names, read_bundle
from .locate import read_target
from .outcome import APPLIED_STATE, NOT_APPLIED, NOT_APPLIED_STATE, OK, STALE_BYTECODE, Decision, Report
from .seal import sha256_hex
from .table import read_releases


def run_check(path: str, pycache_prefix: "str | None", *, exact: bool = False) -> Report:
    data, text = read_target(path)
    decision = decide_by_hash(data)
    if decision is None:
        return check_by_the_diffs(path, data, text, pycache_prefix, exact=exact)
    return checked(path, data, decision, None, pycache_prefix)


def known_files(table: str) -> dict[str, tuple[str, str]]:
    """sha256 -> (state, diff name), for each release's file and the file its diff makes
    of it, from the release table's text. ValueError if the table is not whole or its rows
    contradict each other."""
    known = {}
    for release in read_releases(table).values():
        known[release.sha256] = (NOT_APPLIED_STATE, release.diff)
        known[release.fixed_sha256] = (APPLIED_STATE, release.diff)
    return known


def decide_by_hash(data: bytes) -> "Decision | None":
    """The decision for a file the release table knows, without parsing a diff: parsing
    costs more than the rest of a --check together. None for any other file, and when
    patches/ is not the set of diffs the table names, and those for upstream main between
    releases (then parsing gives the reason). The answer rests on the table, which is
    sealed; of the diffs only the one it names is read, and must be whole, as apply and
    revert will use it (hashing every diff would cost a tenth of the gate)."""
    try:
        with open(bundle.TABLE, encoding="utf-8") as f:
            known = known_files(f.read())
        names = set(diff_names(bundle.PATCHES_DIR))
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None
    state, name = known.get(sha256_hex(data), (None, None))
    named = {diff for _, diff in known.values()}
    if name is None or not named <= names or not all(diff_commit(n) for n in names - named):
        return None
    try:
        with open(os.path.join(bundle.PATCHES_DIR, name), encoding="utf-8", newline="") as f:
            check_integrity(name, f.read())  # exit 5 if it is not whole, as a parse would say
    except (OSError, UnicodeDecodeError):
        return None
    return Decision(state, Fix(name, ()))


def check_by_the_diffs(path: str, data: bytes, text: "str | None", pycache_prefix: "str | None", *, exact: bool) -> Report:
    """A file the table does not know: parsed diffs, adaptation, an earlier bundle's fix,
    the loop probe. (Imported here: a known file, the gate's usual case, needs none of them.)"""
    from .earlier import decide_file
    from .judged import by_behaviour
    from .outcome import DRIFTED_STATE
    from .reports import drifted

    fixes = read_bundle()
    # Exit 5 if a known earlier fix's diff does not give its release back, as apply will need.
    earlier, _, decision, adaptation = decide_file(data, text, fixes, exact=exact)
    if earlier is not None:
        return earlier_report(data, earlier, decision, adaptation)
    if decision.state == DRIFTED_STATE:
        judged = not exact and by_behaviour(path, data, text, fixes, pycache_prefix)
        return judged or drifted(path, data, text, fixes)
    from .proof import known_file, unproven

    # A file the table does not know (a build, a release newer than the table, a vendor's)
    # where a diff's functions stand, exactly or adapted, is no proof that the rest of it
    # reads as the release does: 0 only once the loop test passes on it.
    unknown = not known_file(data)
    if decision.state == APPLIED_STATE and unknown:
        failure = unproven(data, path, decision, adaptation)
        if failure is not None:
            return drifted(path, data, text, fixes, reason=failure)
    return checked(path, data, decision, adaptation, pycache_prefix, unknown=unknown)


def earlier_report(data: bytes, earlier, decision, adaptation) -> Report:
    """1: an earlier bundle's fix, which apply replaces with the diff that fits the release."""
    from .adapt import adapted_words

    name, how = decision.fix.name, f" ({adapted_words(adaptation)})" if adaptation is not None else ""
    message = (f"not applied: an earlier bundle's fix (patches/{earlier.path}); apply.py puts"
               f" patches/{name}{how} in its place")
    return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=message, diff=name, before=data, after=data,
                  adapted=adaptation is not None)


def checked(path: str, data: bytes, decision, adaptation, pycache_prefix: "str | None", *, unknown: bool = False) -> Report:
    """0 applied (1 if stale bytecode of the release would run instead), 1 not applied.
    unknown: a file the table does not know, proven by the loop test if applied, and
    to be proven before apply writes it if not."""
    name = decision.fix.name
    if decision.state == APPLIED_STATE:
        from .bytecode import stale_bytecode_files  # here: a file not applied has no stale bytecode to find

        stale = stale_bytecode_files(sorted({path, os.path.realpath(path)}), data, pycache_prefix)
        if stale:
            message = (
                f"{STALE_BYTECODE}{stale[0]} would run instead of the fixed source (patches/{name}; apply.py removes it)"
            )
            return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=message, diff=name, before=data, after=data)
    adapted = adaptation is not None
    how = ""
    if adapted:  # a build between releases, or a release the table does not reach yet: name it
        from .adapt import adapted_words
        from .installed import describe, installed_distribution, newer_words

        distribution = installed_distribution(path)
        how = f"; {adapted_words(adaptation)}" + (f"; {describe(distribution)}" if newer_words(distribution) else "")
    if decision.state == APPLIED_STATE:
        how += "; proven by the loop test" if unknown else ""
        return Report(code=OK, state=APPLIED_STATE, message=f"applied (patches/{name}{how})", diff=name,
                      before=data, after=data, adapted=adapted)
    proof = "; apply.py proves it with the loop test before it writes" if unknown else ""
    return Report(code=NOT_APPLIED, state=NOT_APPLIED_STATE, message=f"not applied (patches/{name} fits{how}{proof})",
                  diff=name, before=data, after=data, adapted=adapted)
