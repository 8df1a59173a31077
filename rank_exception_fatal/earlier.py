"""Files an earlier bundle fixed: known by their sha256 (releases/superseded.tsv), or, where
that bundle adapted its fix, by the fix's own lines; each taken back to the text it was
made on by that bundle's own diff (patches/superseded/, or today's), so that apply puts
this bundle's fix in their place and revert gives that text. Read only for a file the
release table does not know."""
from __future__ import annotations

import os
from collections.abc import Sequence

from . import bundle
from .bundle import Fix, parse_fix, read_table_text
from .match import fingerprint, rewrite, split_lines
from .outcome import APPLIED_STATE, BAD_BUNDLE, DRIFTED_STATE, NOT_APPLIED_STATE, Failure
from .seal import sha256_hex
from .table import EarlierFix, read_earlier_fixes, read_releases


def decide_file(data: bytes, text: str | None, fixes: Sequence[Fix], *, exact: bool):
    """(earlier, text, Decision, Adaptation): for a file an earlier bundle fixed, which
    today's bundle fixes otherwise, that fix (EarlierFix or AdaptedEarlier) and the text
    it was made on, with the decision of that text; for any other file, None and the
    file's own text with its decision."""
    from .decide import decide_any

    row = earlier_fix(data)
    if row is not None:
        before = release_text(row, text)
        decision, adaptation = decide_any(before, fixes, exact=exact)
        if decision.state == NOT_APPLIED_STATE:
            return row, before, decision, adaptation
    decision, adaptation = decide_any(text, fixes, exact=exact)
    adapted_applied = decision.state == APPLIED_STATE and adaptation is not None
    if text is not None and "\0" not in text and (decision.state == DRIFTED_STATE or adapted_applied):
        found = adapted_earlier(text, fixes, exact=exact)
        if found is not None:
            return found
    return None, text, decision, adaptation


def earlier_fix(data: bytes) -> EarlierFix | None:
    """The row for a file an earlier bundle's diff made; None for any other (a release's
    file, or the one its diff makes, without reading the earlier fixes). Exit 5 if a table
    read is not whole or they disagree."""
    try:
        releases = read_releases(read_table_text())
    except ValueError as e:
        raise Failure(BAD_BUNDLE, f"releases/releases.tsv {e}") from None
    digest = sha256_hex(data)
    if any(digest in (release.sha256, release.fixed_sha256) for release in releases.values()):
        return None
    try:
        names = bundle.diff_names(bundle.EARLIER_DIR)
        with open(bundle.EARLIER_TABLE, encoding="utf-8", newline="") as f:
            earlier = read_earlier_fixes(f.read(), releases, names)
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the earlier fixes ({e}); copy the bundle again") from None
    except ValueError as e:
        raise Failure(BAD_BUNDLE, f"releases/superseded.tsv {e}") from None
    return earlier.get(digest)


def release_text(row: EarlierFix, text: str) -> str:
    """The release's text the file was made from, by the earlier diff taken back; exit 5
    unless that gives the release's bytes (a damaged bundle)."""
    name = f"superseded/{row.diff}"
    try:
        with open(os.path.join(bundle.EARLIER_DIR, row.diff), encoding="utf-8", newline="") as f:
            fix = parse_fix(name, f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read patches/{name}: {e}; copy the bundle again") from None
    lines = split_lines(text)
    released = rewrite(lines, fix, revert=True) if fingerprint(lines, fix) == APPLIED_STATE else None
    if released is None or sha256_hex(released.encode("utf-8")) != row.sha256:
        raise Failure(BAD_BUNDLE, f"patches/{name} does not take the file back to vllm {row.version}'s: copy the bundle again")
    return released


class AdaptedEarlier:
    """A file an earlier bundle adapted (a build between releases, or a release newer than
    that bundle's table), known by its diff's own lines: path, the diff under patches/;
    sha256, of the text that diff taken back gives. (As EarlierFix for a known file.)"""

    __slots__ = ("path", "sha256", "version")

    def __init__(self, path: str, sha256: str) -> None:
        self.path, self.sha256, self.version = path, sha256, None


def adapted_earlier(text: str, fixes: Sequence[Fix], *, exact: bool):
    """(AdaptedEarlier, the text before it, Decision, Adaptation) for a file in which an
    earlier bundle's change stands by its own lines (that bundle adapted it to a file no
    diff fitted), and whose text before it today's bundle fixes otherwise: with a diff of
    its own, or placed otherwise. Proof that the text before is the one the
    earlier change was made on: placing that change on it again gives the file byte for
    byte. With exact, only where the text before is a release's file, byte for byte.
    None for any other file, today's adapted fix among them."""
    from .adapt import narrowed
    from .decide import decide_any

    lines = split_lines(text)
    # Read only under --exact: the table was read and checked just before (earlier_fix).
    releases = {release.sha256 for release in read_releases(read_table_text()).values()} if exact else set()
    seen = set()
    for path, fix in candidate_fixes(fixes):
        narrow, _ = narrowed(fix)
        key = tuple((tuple(h.before), tuple(h.after)) for h in narrow.hunks)
        if key in seen:
            continue  # many diffs of the history narrow to the same lines
        seen.add(key)
        if fingerprint(lines, narrow) != APPLIED_STATE:
            continue
        before = rewrite(lines, narrow, revert=True)
        if rewrite(split_lines(before), narrow) != text:
            continue
        digest = sha256_hex(before.encode("utf-8"))
        if exact and digest not in releases:
            continue
        decision, adaptation = decide_any(before, fixes, exact=exact)
        if decision.state != NOT_APPLIED_STATE or rewrite(split_lines(before), decision.fix if adaptation is None
                                                           else adaptation.fix) == text:
            continue  # not fixed today, or fixed today as it stands: not an earlier fix
        return AdaptedEarlier(path, digest), before, decision, adaptation
    return None


def candidate_fixes(fixes: Sequence[Fix]):
    """(path under patches/, Fix): today's diffs, then every earlier bundle's."""
    for fix in fixes:
        yield fix.name, fix
    try:
        names = bundle.diff_names(bundle.EARLIER_DIR)
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(bundle.EARLIER_DIR, name), encoding="utf-8", newline="") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise Failure(BAD_BUNDLE, f"cannot read patches/superseded/{name}: {e}; copy the bundle again") from None
        yield f"superseded/{name}", parse_fix(f"superseded/{name}", text)
