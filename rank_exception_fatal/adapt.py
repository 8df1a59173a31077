"""Adaptation: for a build between releases that no diff fits exactly, place the closest
diff by its own changed lines, in the functions of the same names.

A build between releases (a vllm-gaudi pin of upstream main) often differs from every
release somewhere in a function a diff carries whole: an argument added to a call, a
docstring. The fix itself may still stand where it was written: its own changed lines
and ADAPT_CONTEXT lines either side, exactly and once, in the function of the same
name. Then the change is placed there, and proven before it is written."""
from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence

from .bindings import dead_fix, rebinding
from .bundle import Fix, Hunk, diff_release, written_for
from .match import enclosing_function, find_block, fingerprint, locate_blocks, nearest, split_lines
from .outcome import NOT_APPLIED_STATE

ADAPT_CONTEXT = 3


# fix: the diff's change narrowed to its own lines, as a Fix whose hunks rewrite() and
# fingerprint() take; functions: the name of the function each narrowed hunk stands in
# (None where the diff's text does not say); differing: how many lines of the diff's
# whole-function text do not stand in the file.
Adaptation = namedtuple("Adaptation", "state fix functions differing")


def narrowed(fix: Fix) -> tuple[Fix, list[str | None]]:
    import difflib

    hunks, functions = [], []
    for hunk in fix.hunks:
        matcher = difflib.SequenceMatcher(None, hunk.before, hunk.after, autojunk=False)
        end = 0
        for group in matcher.get_grouped_opcodes(ADAPT_CONTEXT):
            (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
            # A change in an except branch takes the whole branch above it: the fix rests
            # on what the branch does, so a branch changed anywhere must not fit.
            widened = except_line_above(hunk.before, i1, end)
            j1 -= i1 - widened
            i1, end = widened, i2
            hunks.append(Hunk(hunk.before[i1:i2], hunk.after[j1:j2]))
            functions.append(enclosing_function(hunk.before, i1))
    return Fix(fix.name, tuple(hunks)), functions


def except_line_above(lines: Sequence[str], index: int, floor: int) -> int:
    """The index of the `except` line whose branch holds lines[index], if it stands at
    floor or below; else index."""
    import re

    first = next((line for line in lines[index:] if line.strip()), "")
    indent = len(first) - len(first.lstrip())
    for k in range(index - 1, floor - 1, -1):
        line = lines[k]
        depth = len(line) - len(line.lstrip())
        if not line.strip() or depth >= indent:
            continue
        if re.match(r" *except\b", line):
            return k
        if re.match(r" *(?:async +)?(?:def|class) ", line):
            return index
        indent = depth  # an if or a with inside the branch: go on up
    return index


def handlers_above(lines: Sequence[str], index: int) -> list[str]:
    """The except clauses of the try statement that the except line lines[index] ends,
    above it, nearest first: an adapted branch must have the release's, so that every
    failure the release's branch sees reaches it."""
    import re

    depth = len(lines[index]) - len(lines[index].lstrip())
    found = []
    for line in reversed(lines[:index]):
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > depth:
            continue
        if indent == depth and re.match(r" *except\b", line):
            found.append(line)
            continue
        break
    return found


def adapt(text: str, fixes: Sequence[Fix]) -> Adaptation | None:
    """For a file that no diff fits: the closest diff whose change can be placed in it
    (not applied), or stands in it (applied), by its own lines; None if none can."""
    import re

    from .proof import undriven_reads

    if undriven_reads(text):
        return None  # the proof would not run every read: drift_reason says so
    lines = split_lines(text)
    found = []
    for fix in fixes:
        narrow, functions = narrowed(fix)
        state = fingerprint(lines, narrow)
        if state is None or rebinding(text, fix) or dead_fix(text, fix):
            continue
        side = [h.before if state == NOT_APPLIED_STATE else h.after for h in narrow.hunks]
        starts = locate_blocks(lines, side)
        if any(name and enclosing_function(lines, start) != name for start, name in zip(starts, functions)):
            continue  # the same lines, in another function
        whole = [h.before if state == NOT_APPLIED_STATE else h.after for h in fix.hunks]
        if any(handlers_above(lines, start) != next((handlers_above(w, at) for w in whole for at in find_block(w, block)), None)
               for block, start in zip(side, starts) if re.match(r" *except\b", block[0])):
            continue  # another except clause in the try statement: a failure it catches never reaches the branch
        found.append(Adaptation(state, narrow, functions, sum(differing_lines(lines, block) for block in whole)))
    # The closest; of equals, the newest release's diff.
    return min(found, key=lambda a: (a.differing, [-n for n in diff_release(a.fix.name) or ()]), default=None)


def differing_lines(lines: Sequence[str], block: Sequence[str]) -> int:
    """How many lines differ (changed, missing or added) between the block and where it
    stands best in the file."""
    _, _, matcher = nearest(lines, block)
    return sum(
        max(i2 - i1, j2 - j1)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal" and not (tag == "delete" and j1 in (0, len(block)))  # file lines around it
    )


def adapted_words(adaptation: Adaptation) -> str:
    return (
        f"adapted: placed by its own lines ({len(adaptation.fix.hunks)} places); written for {written_for(adaptation.fix.name)},"
        f" whose changed functions differ here in {adaptation.differing} line{'s' * (adaptation.differing != 1)}"
    )
