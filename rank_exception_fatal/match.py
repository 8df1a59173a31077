"""Pure matching over the file's lines: where a diff's hunks stand, which side of it the
file holds, the file rewritten to the other side, and where a block stands nearest."""
from __future__ import annotations

from collections.abc import Sequence

from .bundle import Fix
from .outcome import APPLIED_STATE, NOT_APPLIED_STATE


def split_lines(text: str) -> list[str]:
    # Only "\n" ends a line, as in the diffs: str.splitlines would also split on
    # form feeds and hide a CRLF file's "\r".
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def find_block(lines: Sequence[str], block: Sequence[str]) -> list[int]:
    lines, block = list(lines), list(block)
    found, start = [], 0
    while True:
        try:
            start = lines.index(block[0], start)  # in C: a --check fingerprints every diff
        except ValueError:
            return found
        if lines[start : start + len(block)] == block:
            found.append(start)
        start += 1


def locate_blocks(lines: Sequence[str], blocks: Sequence[Sequence[str]]) -> list[int] | None:
    """Where each block stands, if each stands exactly once and in order; else None."""
    starts = []
    end = 0
    for block in blocks:
        found = find_block(lines, block)
        if len(found) != 1 or found[0] < end:
            return None
        starts.append(found[0])
        end = found[0] + len(block)
    return starts


def fingerprint(lines: Sequence[str], fix: Fix) -> str | None:
    # Each hunk carries the whole function it changes as context, so finding every
    # hunk exactly means those functions are byte-identical to the release's. The
    # other side's text must stand nowhere: with both, which one runs is a guess,
    # and a rewrite would leave a file that reads as neither.
    befores = [hunk.before for hunk in fix.hunks]
    afters = [hunk.after for hunk in fix.hunks]
    if locate_blocks(lines, befores) is not None and not any(find_block(lines, b) for b in afters):
        return NOT_APPLIED_STATE
    if locate_blocks(lines, afters) is not None and not any(find_block(lines, b) for b in befores):
        return APPLIED_STATE
    return None


def rewrite(lines: Sequence[str], fix: Fix, *, revert: bool = False) -> str:
    """The file's text with every hunk swapped: release -> fixed, or back with revert."""
    pairs = [(h.after, h.before) if revert else (h.before, h.after) for h in fix.hunks]
    starts = locate_blocks(lines, [old for old, _ in pairs])
    assert starts is not None, "rewrite() needs a file the fix matches"
    result = list(lines)
    for start, (old, new) in reversed(list(zip(starts, pairs))):
        result[start : start + len(old)] = new
    return "".join(result)


def enclosing_function(lines: Sequence[str], index: int) -> str | None:
    """The def or class that holds lines[index]: the nearest one above, less indented
    than the first non-blank line from there."""
    import re

    first = next((line for line in lines[index:] if line.strip()), "")
    indent = len(first) - len(first.lstrip())
    for line in reversed(lines[:index]):
        found = re.match(r"( *)(?:async +)?(?:def|class) +(\w+)", line)
        if found and len(found.group(1)) < indent:
            return found.group(2)
    return None


def nearest(lines: Sequence[str], block: Sequence[str]):
    """(share of the block's lines in place, first file line of the region, matcher) where
    the block stands best: around its longest run in the file, with room for lines added."""
    import difflib

    a, b, _ = difflib.SequenceMatcher(None, lines, block, autojunk=False).find_longest_match(
        0, len(lines), 0, len(block)
    )
    start = max(0, a - b - len(block))
    region = list(lines[start : a - b + 2 * len(block)])
    matcher = difflib.SequenceMatcher(None, region, block, autojunk=False)
    in_place = sum(size for _, _, size in matcher.get_matching_blocks())
    return in_place / len(block), start, matcher
