"""Write the bundle diff for one release: release file + hand-patched copy -> unified diff.

    python3 scripts/make_diff.py RELEASE_FILE PATCHED_FILE > patches/vX.Y.Z.diff

apply.py fingerprints a release by finding each hunk's pre-image exactly. Three
lines of context would let a release whose changed function differs elsewhere
pass as a match, so each hunk's context is widened (symmetrically: GNU patch
reads uneven context as "anchor at the end of the file") until it carries the
whole function it changes, decorators included, and no further. The first line
is the sha256 of the rest, which apply.py checks.

To regenerate the bundle's diff for a release after editing its copy (kept
outside the repo, e.g. in ~/.cache/rank-exception-fatal/edited/vX/):

    python3 scripts/make_diff.py "$(python3 scripts/fetch_release.py X)/vllm/v1/executor/multiproc_executor.py" EDITED > patches/vX.diff

After any change to releases/releases.tsv (a row added, a fixed_sha256 changed), seal it
again: its first line is the sha256 of the rest, which apply.py checks as it checks a diff's:

    python3 scripts/make_diff.py --table
"""
from __future__ import annotations

import ast
import difflib
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the bundle's package

from rank_exception_fatal.bundle import TABLE  # noqa: E402
from rank_exception_fatal.outcome import TARGET  # noqa: E402
from rank_exception_fatal.seal import HEADER, seal  # noqa: E402


def function_spans(source: str) -> list[tuple[int, int]]:
    """(first line, last line) of every function, decorators included; 1-based."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((first, node.end_lineno))
    return spans


def needed_context(i1: int, i2: int, spans: Sequence[tuple[int, int]]) -> int:
    """Lines of context on each side for a change of old lines i1:i2 to carry its function."""
    # A pure insertion sits after old line i1; a replacement starts at i1 + 1.
    anchor = i1 if i1 == i2 else i1 + 1
    enclosing = [s for s in spans if s[0] <= anchor <= s[1]]
    if not enclosing:
        return 3
    first, last = max(enclosing)  # the innermost starts last
    return max(3, i1 - first + 1, last - i2)


def hunk_groups(old_lines: list[str], new_lines: list[str], spans) -> list[tuple[list, int]]:
    """The changes grouped into hunks, each with its own context: (opcodes, context).

    Each hunk gets the context its own functions need, not the widest any hunk
    needs: context reaching into neighbouring functions would tie the diff to
    releases whose neighbours are the same too. Hunks whose windows meet merge,
    and take the larger context, which still covers each change's function."""
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    groups = [([op], needed_context(op[1], op[2], spans)) for op in matcher.get_opcodes() if op[0] != "equal"]
    merged = True
    while merged:
        merged = False
        for k in range(len(groups) - 1):
            (ops, context), (next_ops, next_context) = groups[k], groups[k + 1]
            if ops[-1][2] + context >= next_ops[0][1] - next_context:
                groups[k : k + 2] = [(ops + next_ops, max(context, next_context))]
                merged = True
                break
    return groups


def unified_hunk(old_lines: list[str], new_lines: list[str], ops: list, context: int) -> str:
    start = max(0, ops[0][1] - context)
    end = min(len(old_lines), ops[-1][2] + context)
    new_start = ops[0][3] - (ops[0][1] - start)
    new_end = ops[-1][4] + (end - ops[-1][2])
    lines = [f"@@ -{hunk_range(start, end)} +{hunk_range(new_start, new_end)} @@\n"]
    at = start
    for _, i1, i2, j1, j2 in ops:
        lines += [" " + line for line in old_lines[at:i1]]
        lines += ["-" + line for line in old_lines[i1:i2]]
        lines += ["+" + line for line in new_lines[j1:j2]]
        at = i2
    lines += [" " + line for line in old_lines[at:end]]
    return "".join(lines)


def hunk_range(start: int, end: int) -> str:
    # As difflib writes it: "first,count" with 1-based first; an empty range names the line before.
    length = end - start
    first = start + 1 if length else start
    return str(first) if length == 1 else f"{first},{length}"


def make_diff(old: str, new: str, path: str = TARGET, *, whole_functions: bool = True) -> str:
    """whole_functions=False: three lines of context, for files the gate knows by sha256
    alone (the exit path's), where a wider fingerprint buys nothing."""
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    groups = hunk_groups(old_lines, new_lines, function_spans(old) if whole_functions else [])
    hunks = [unified_hunk(old_lines, new_lines, ops, context) for ops, context in groups]
    # The seal: apply.py refuses a diff whose lines below its first no longer have that
    # sha256 (a copy cut short at a hunk boundary still parses). git apply and patch skip
    # it as text before the diff.
    return seal(f"--- a/{path}\n+++ b/{path}\n" + "".join(hunks))


def creation_diff(text: str, path: str) -> str:
    """The sealed diff that creates path holding text (git apply and patch -p1 take it);
    text ends with a newline (this writes no "No newline at end of file" marker)."""
    if not text.endswith("\n"):
        raise ValueError(f"{path}: the text must end with a newline")
    lines = text.splitlines(keepends=True)
    return seal(f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +{hunk_range(0, len(lines))} @@\n" + "".join("+" + line for line in lines))


TABLE_HEADER = HEADER  # the table is sealed as a diff is


def seal_table(path: str) -> None:
    """Write the release table's first line again: the sha256 of the lines below it,
    which apply.py checks (a row edited by hand, or a table cut short, is a bundle error).
    Run after every change to releases/releases.tsv: python3 scripts/make_diff.py --table"""
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if text.startswith(TABLE_HEADER):
        text = text.partition("\n")[2]
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(seal(text))


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--table"]:
        seal_table(args[1] if len(args) > 1 else TABLE)
        return 0
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 6
    with open(args[0], encoding="utf-8", newline="") as f:
        old = f.read()
    with open(args[1], encoding="utf-8", newline="") as f:
        new = f.read()
    sys.stdout.write(make_diff(old, new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
