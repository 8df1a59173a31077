"""The release table (releases/releases.tsv): its one reader, for apply.py and the scripts alike."""
from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence

from .seal import DAMAGED, HEADER, unsealed

# version; the diff in patches/ that fixes it; the sha256 of its TARGET and of the file
# the diff makes of it (--check decides a known file by these two); whether its parallel
# config has enable_fault_tolerance (yes/no); the wheel the file is read from; whether
# the sdist holds the same bytes (same/differs/none).
Release = namedtuple("Release", "version diff sha256 fixed_sha256 fault_tolerance wheel sdist")

HEX_DIGITS = frozenset("0123456789abcdef")


def read_releases(table: str, diffs: Sequence[str] | None = None, *, sealed: bool = True) -> dict[str, Release]:
    """version -> Release, from the table's text, oldest first. ValueError saying what is
    wrong if the table is not whole or contradicts itself, or names a diff not among
    diffs (when given). sealed=False: for the scripts that edit it, a table whose seal
    is not written yet."""
    problem = table_problem(table, diffs, sealed=sealed)
    if problem:
        raise ValueError(problem)
    return {row[0]: Release(*row) for row in table_rows(table)[1]}


def table_rows(table: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows): tab-separated; # starts a comment (the seal is one)."""
    header, *rows = [line.split("\t") for line in table.splitlines() if line.strip() and not line.startswith("#")] or [[]]
    return header, rows


def table_problem(table: str, diffs: Sequence[str] | None = None, *, sealed: bool = True) -> str | None:
    """What is wrong with the release table's text, if anything: its first line is the
    sha256 of the rest, as a diff's is (scripts/make_diff.py --table writes it); each
    row's fixed file differs from its release's and from every release's, no version
    is listed twice, a file is one diff's, and each diff it names is in the bundle
    (diffs, when given)."""
    _, broken = unsealed(table) if sealed else (None, None)
    if broken == DAMAGED:
        return "is cut short or damaged (its sha256 differs): copy the bundle again"
    if broken:
        return f"does not start with {HEADER.strip()!r}: write it with scripts/make_diff.py --table"
    header, rows = table_rows(table)
    if tuple(header) != Release._fields:
        return f"must have the columns {' '.join(Release._fields)}"
    seen: set[str] = set()
    owner: dict[str, tuple[str, str]] = {}  # sha256 -> (diff, side)
    for row in rows:
        release = Release(*row) if len(row) == len(header) else None
        problem = row_problem(release, row, seen, owner, diffs)
        if problem:
            return problem
    return None


def row_problem(release: Release | None, row: list[str], seen: set[str], owner: dict[str, tuple[str, str]],
                diffs: Sequence[str] | None) -> str | None:
    if release is None or not all(len(d) == 64 and set(d) <= HEX_DIGITS for d in (release.sha256, release.fixed_sha256)):
        return f"has a malformed row: {row[0]!r}"
    if release.fault_tolerance not in ("yes", "no") or release.sdist not in ("same", "differs", "none"):
        return f"has a malformed row: {row[0]!r}"
    if release.version in seen:
        return f"lists {release.version} twice"
    seen.add(release.version)
    if release.fixed_sha256 == release.sha256:
        return f"gives {release.version} a fixed_sha256 equal to its sha256: the release would read as applied"
    if diffs is not None and release.diff not in diffs:
        return f"names {release.diff} for {release.version}, which is not in patches/: copy the bundle again"
    for digest, side in ((release.sha256, "release"), (release.fixed_sha256, "fixed")):
        if owner.setdefault(digest, (release.diff, side)) != (release.diff, side):
            return f"row {release.version}: {digest} is already another diff's or the other side's file"
    return None
