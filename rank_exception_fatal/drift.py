"""Why a file is drift, in words for the operator: what in it parts from the diff nearest
to its shape, or what else stops the fix from being the code that runs."""
from __future__ import annotations

from collections.abc import Sequence

from .bindings import dead_fix, rebinding
from .bundle import Fix
from .match import find_block, fingerprint, nearest, split_lines


def drift_reason(data: bytes, text: str | None, fixes: Sequence[Fix]) -> str:
    if not data:
        return "the file is empty"
    if text is None:
        return "the file is not UTF-8 text"
    if "\0" in text:
        return "the file holds NUL bytes"
    if "\r\n" in text:
        return "the file has CRLF line endings; vLLM releases use LF"
    lines = split_lines(text)
    for fix in fixes:
        if fingerprint(lines, fix) and rebinding(text, fix):
            return f"{fix.name} fits, but {rebinding(text, fix)}"
        if fingerprint(lines, fix) and dead_fix(text, fix):
            return dead_fix(text, fix)
    from .proof import undriven_reads, undriven_words

    undriven = undriven_reads(text)
    if undriven:
        return undriven_words(undriven)
    return closest_difference(lines, fixes)


def closest_difference(lines: Sequence[str], fixes: Sequence[Fix]) -> str:
    """Where the file parts from the texts the diffs expect, for the drift message."""
    for fix in fixes:
        conflict = standing_conflict(lines, fix)
        if conflict:
            return conflict
    miss = nearest_miss(lines, fixes)
    if miss is None:
        return "each hunk's text stands, but not in the diff's order"
    return difference_words(*miss)


def standing_conflict(lines: Sequence[str], fix: Fix) -> str | None:
    """Text of the diff that stands where it must not: both sides of a hunk, a side twice,
    or some hunks applied and the others not."""
    for number, hunk in enumerate(fix.hunks, 1):
        before, after = find_block(lines, hunk.before), find_block(lines, hunk.after)
        if before and after:
            return (
                f"{fix.name} hunk {number}: its release text (line {before[0] + 1}) and its fixed text"
                f" (line {after[0] + 1}) both stand; only one may"
            )
        for side, found in (("release", before), ("fixed", after)):
            if len(found) > 1:
                lines_at = ", ".join(str(i + 1) for i in found)
                return f"{fix.name} hunk {number}: its {side} text stands {len(found)} times (lines {lines_at})"
    patched = [bool(find_block(lines, hunk.after)) for hunk in fix.hunks]
    pristine = [bool(find_block(lines, hunk.before)) for hunk in fix.hunks]
    if all(p or r for p, r in zip(patched, pristine)) and any(patched) and not all(patched):
        done = ", ".join(str(n) for n, p in enumerate(patched, 1) if p)
        return f"half-applied: {fix.name} hunk {done} is in place, the rest is not (a patch tool stopped half-way?)"
    return None


def nearest_miss(lines: Sequence[str], fixes: Sequence[Fix]):
    """The diff nearest to the file's own shape: the one with the largest share of its
    text in place, over all its hunks. (The hunk nearest on its own can belong to a diff
    far from this file: a function that many releases share stands in it whole.) Then,
    of that diff's hunks that do not stand, the one nearest to standing: (start, matcher,
    fix, hunk number, side, block), or None if every hunk of every diff stands."""
    best = None
    for fix in fixes:
        in_place, size, misses = 0.0, 0, []
        for number, hunk in enumerate(fix.hunks, 1):
            size += len(hunk.before)
            if find_block(lines, hunk.before) or find_block(lines, hunk.after):
                in_place += len(hunk.before)  # this one stands; the difference is elsewhere
                continue
            near, side, block = max(
                ((nearest(lines, block), side, block) for side, block in (("release", hunk.before), ("fixed", hunk.after))),
                key=lambda candidate: candidate[0][0],
            )
            in_place += near[0] * len(hunk.before)
            misses.append((*near, fix, number, side, block))
        if misses and (best is None or in_place / size > best[0]):
            best = (in_place / size, max(misses, key=lambda miss: miss[0]))
    return best[1][1:] if best else None


def difference_words(start: int, matcher, fix: Fix, number: int, side: str, block: Sequence[str]) -> str:
    """The first line where the block and the file's region around it differ."""
    region = matcher.a
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        # Lines of the file before or after the block are not part of the difference.
        if tag == "equal" or (tag == "delete" and j1 in (0, len(block))):
            continue
        # A line the file lacks, or has in excess, is named as such: quoting the lines on
        # either side of the gap can print two identical lines (two blank lines, say).
        if tag == "delete":
            expected = "(no line here)"
        else:
            expected = repr(block[j1]) if j1 < len(block) else "(end of the hunk)"
        if tag == "insert":
            found = "(missing)"
        else:
            found = repr(region[i1]) if i1 < len(region) else "(end of file)"
        return (
            f"closest: {fix.name} hunk {number} ({side} text), line {start + i1 + 1}:\n"
            f"    expected: {expected}\n"
            f"    found:    {found}"
        )
    return f"closest: {fix.name} hunk {number} ({side} text) stands out of order"
