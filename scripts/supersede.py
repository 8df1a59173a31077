"""Keep the fixes of earlier bundles: every file an earlier commit's diff made of a release
(or of a build of releases/builds.tsv that a diff fits exactly) that this bundle's diff
does not make, so that apply.py can put this bundle's fix in its
place (and revert can take it back to the release) instead of reading it as drift.

    python3 scripts/supersede.py

Run it after changing a diff, before committing: it reads each commit of this repository
that changed patches/ or releases/, makes each release's (and build's) fixed file with the
diff that commit named for it (on the real bytes, scripts/fetch_release.py), and
writes every fixed file that differs from the one releases/releases.tsv names now:
its diff, sealed, as patches/superseded/<diff>@<commit>.diff (the first commit that had
that text), and a row in releases/superseded.tsv (sealed as the release table is).
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from fetch_release import HERE, TABLE_ROWS, build_name, build_tree, read_builds, release_tree

from rank_exception_fatal.bundle import EARLIER_DIR, EARLIER_TABLE, parse_fix
from rank_exception_fatal.match import fingerprint, rewrite, split_lines
from rank_exception_fatal.outcome import NOT_APPLIED_STATE, TARGET
from rank_exception_fatal.seal import HEADER, seal, sha256_hex
from rank_exception_fatal.table import EARLIER_COLUMNS, table_rows

TABLE_NOTE = """\
# Files earlier bundles made of a release, which this bundle's diffs do not make: apply.py
# takes such a file back to the release with its diff (patches/superseded/) and puts this
# bundle's fix in its place; revert gives the release. Written by scripts/supersede.py.
"""


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, check=True).stdout


def git_file(commit: str, path: str) -> str | None:
    done = subprocess.run(["git", "-C", HERE, "show", f"{commit}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def named_in(text: str | None, key: str) -> dict[str, str]:
    """key column -> diff, from a table's text (releases.tsv, builds.tsv) at some commit."""
    if text is None:
        return {}
    header, rows = table_rows(text)
    return {row[header.index(key)]: row[header.index("diff")] for row in rows}


def diffs_named(commit: str) -> dict[str, str]:
    """sha256 of a release's or build's file -> the diff the commit named for it (before
    there was a release table, each vX.Y.Z.diff for release X.Y.Z)."""
    names = [n for n in git("ls-tree", "--name-only", f"{commit}:patches").split() if n.endswith(".diff")]
    releases = git_file(commit, "releases/releases.tsv")
    if releases is None:
        named = {release.sha256: f"v{version}.diff" for version, release in TABLE_ROWS.items()}
    else:
        named = {TABLE_ROWS[version].sha256: diff for version, diff in named_in(releases, "version").items()
                 if version in TABLE_ROWS}
    named.update(named_in(git_file(commit, "releases/builds.tsv"), "sha256"))
    return {digest: name for digest, name in named.items() if name in names}


def sources() -> dict[str, tuple[str, str, str]]:
    """sha256 -> (name, the tree holding it, the fixed file's sha256 today or None) for each
    release and each build a diff fits exactly (an adapted build's fixed file depends on how
    the diff was placed, which the diff alone does not say)."""
    found = {release.sha256: (version, release_tree(version), release.fixed_sha256)
             for version, release in TABLE_ROWS.items()}
    for build in read_builds():
        if build.fits == "exactly":
            found.setdefault(build.sha256, (build_name(build), build_tree(build), None))
    return found


def sealed(text: str) -> str:
    """The diff sealed: earlier diffs may predate the seal."""
    body = text.partition("\n")[2] if text.startswith(HEADER) else text
    return seal(body)


def made(tree: str, fix) -> str | None:
    """The sha256 of the file the fix makes of the tree's, if it fits it exactly."""
    with open(os.path.join(tree, TARGET), encoding="utf-8", newline="") as f:
        lines = split_lines(f.read())
    return sha256_hex(rewrite(lines, fix).encode("utf-8")) if fingerprint(lines, fix) == NOT_APPLIED_STATE else None


def made_today(known: dict[str, tuple[str, str, str]]) -> set[str]:
    """The files this bundle's diffs make (a build's, by the diff that fits it today)."""
    today = {fixed for _, _, fixed in known.values() if fixed}
    with open(os.path.join(HERE, "releases", "builds.tsv"), encoding="utf-8") as f:
        builds = named_in(f.read(), "sha256")
    for digest, name in builds.items():
        if digest in known and not known[digest][2]:
            with open(os.path.join(HERE, "patches", name), encoding="utf-8", newline="") as f:
                today.add(made(known[digest][1], parse_fix(name, f.read())))
    return today


def earlier_fixes() -> tuple[list[list[str]], dict[str, str]]:
    """(rows of releases/superseded.tsv, file name -> sealed diff text)."""
    commits = git("rev-list", "--reverse", "HEAD", "--", "patches", "releases").split()
    known = sources()
    current = made_today(known)
    rows: dict[str, list[str]] = {}  # fixed sha256 -> row
    files: dict[str, str] = {}  # sealed text -> file name
    for commit in commits:
        for digest, name in diffs_named(commit).items():
            if digest not in known:
                continue
            source, tree, _ = known[digest]
            text = sealed(git_file(commit, f"patches/{name}"))
            fixed = made(tree, parse_fix(name, text))
            if fixed is None or fixed in current or fixed in rows:
                continue  # a diff that did not fit this file as it stands now, or today's fix
            file = files.setdefault(text, f"{name[:-len('.diff')]}@{commit[:8]}.diff")
            rows[fixed] = [source, file, digest, fixed]
    return list(rows.values()), {name: text for text, name in files.items() if any(r[1] == name for r in rows.values())}


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args:
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 6
    rows, files = earlier_fixes()
    os.makedirs(EARLIER_DIR, exist_ok=True)
    for name in os.listdir(EARLIER_DIR):
        if name.endswith(".diff") and name not in files:
            os.remove(os.path.join(EARLIER_DIR, name))
    for name, text in files.items():
        with open(os.path.join(EARLIER_DIR, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    body = TABLE_NOTE + "\t".join(EARLIER_COLUMNS) + "\n" + "".join("\t".join(row) + "\n" for row in rows)
    with open(EARLIER_TABLE, "w", encoding="utf-8", newline="") as f:
        f.write(seal(body))
    print(f"{len(rows)} earlier fixed files, {len(files)} diffs in patches/superseded/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
