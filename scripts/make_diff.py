"""Write the bundle diff for one release: release file + hand-patched copy -> unified diff.

    python3 scripts/make_diff.py RELEASE_FILE PATCHED_FILE > patches/vX.Y.Z.diff

apply.py fingerprints a release by finding each hunk's pre-image exactly. Three
lines of context would let a release whose changed function differs elsewhere
pass as a match, so the context is widened (symmetrically: GNU patch reads
uneven context as "anchor at the end of the file") until every hunk carries the
whole function it changes, decorators included. The first line is the sha256
of the rest, which apply.py checks.

To regenerate the bundle's diff for a release after editing its copy (kept
outside the repo, e.g. in ~/.cache/rank-exception-fatal/edited/vX/):

    python3 scripts/make_diff.py "$(python3 scripts/fetch_release.py X)/vllm/v1/executor/multiproc_executor.py" EDITED > patches/vX.diff
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import sys
from collections.abc import Sequence

from fetch_release import TARGET


def function_spans(source: str) -> list[tuple[int, int]]:
    """(first line, last line) of every function, decorators included; 1-based."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((first, node.end_lineno))
    return spans


def context_covering_functions(old: str, new: str) -> int:
    old_lines, new_lines = old.splitlines(), new.splitlines()
    spans = function_spans(old)
    context = 3
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        # A pure insertion sits after old line i1; a replacement starts at i1 + 1.
        anchor = i1 if i1 == i2 else i1 + 1
        enclosing = [s for s in spans if s[0] <= anchor <= s[1]]
        if not enclosing:
            continue
        first, last = max(enclosing)  # the innermost starts last
        context = max(context, i1 - first + 1, last - i2)
    return context


# The first line of every diff: apply.py refuses a diff whose lines below it no
# longer have this sha256 (a copy cut short at a hunk boundary still parses).
# git apply and patch skip it as text before the diff.
HEADER = "# sha256 of the lines below: "


def make_diff(old: str, new: str) -> str:
    body = "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"a/{TARGET}",
            tofile=f"b/{TARGET}",
            n=context_covering_functions(old, new),
        )
    )
    return f"{HEADER}{hashlib.sha256(body.encode('utf-8')).hexdigest()}\n{body}"


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
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
