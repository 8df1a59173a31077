"""Write the diffs of the set's other files (the API server's exit path, issue 35; the message
queue's heartbeat, issue 46) for every release in releases/releases.tsv.

    python3 scripts/make_exit_diffs.py [--helper FILE]

For each release it reads the launcher, the server file and the queue out of the wheel (cached
beside the executor, in fetch_release.py's cache), places the hooks with ast and makes
the diff as scripts/make_diff.py makes the executor's, sealed, with three lines of context
(the exit path's files are known by sha256, so a wider fingerprint buys nothing).
A diff serves every release whose hunks are the same text (line numbers aside), and is
named by the oldest: patches/launcher/vX.diff, patches/server/vX.diff, patches/queue/vX.diff. Then it writes
releases/exit_path.tsv (sealed), one row a release: for each role the file's path (the
diff's target, so that the gate need not read the diffs), the diff, and the sha256 of the
release's file and of the fixed one. --helper FILE first writes
patches/helper/helper.diff, the creation of vllm/entrypoints/_rank_exception_fatal.py,
from FILE: that diff is the module's only copy in the bundle (edit a copy of it, then
run this).

The hooks, each the import of that module and one call, first in its function (after a
docstring), except run_server's last call and the queue's, after the statement that makes
the socket between nodes what it is (rank_exception_fatal/hooks.py):
    launcher  terminate_if_errored              engine_checked(engine)
    launcher  serve_http > signal_handler       stop_requested(app)
    server    run_server                        arm() first, exit_if_engine_died() last
    queue     MessageQueue > __init__           heartbeat(self.remote_socket), the remote XPUB's
    queue     MessageQueue > create_from_handle heartbeat(self.remote_socket), the remote SUB's
"""
from __future__ import annotations

import ast
import os
import sys
from collections.abc import Sequence

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "scripts"))

import fetch_release  # noqa: E402
from make_diff import creation_diff, make_diff  # noqa: E402

from rank_exception_fatal.hooks import AFTER, HOOKS, function, import_line, own_returns, statement_after  # noqa: E402
from rank_exception_fatal.seal import seal  # noqa: E402
from rank_exception_fatal.table import EXIT_PATH_COLUMNS, ROLES  # noqa: E402

HELPER_PATH = "vllm/entrypoints/_rank_exception_fatal.py"
HELPER_DIFF = os.path.join(HERE, "patches", "helper", "helper.diff")
PLACES = fetch_release.EXIT_PATH_PLACES


def hooked(source: str, role: str) -> str:
    """source with role's hooks placed; LookupError if a function is not there as expected."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    inserts = []  # (0-based line index to insert before, lines)
    for names, where, call in HOOKS[role]:
        fn = function(tree, names)
        if where.startswith(AFTER):
            block, index = statement_after(fn, where)
            indent = " " * block[index].col_offset
            inserts.append((block[index].end_lineno, [f"{indent}{import_line(role)}\n", f"{indent}{call}\n"]))
            continue
        body = fn.body
        has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str)
        first = body[1] if has_docstring else body[0]
        indent = " " * first.col_offset
        if where == "first":
            inserts.append((first.lineno - 1, [f"{indent}{import_line(role)}\n", f"{indent}{call}\n"]))
        else:
            if own_returns(fn):
                raise LookupError(f"{' > '.join(names)} returns early: a last call would not always run")
            inserts.append((fn.end_lineno, [f"{indent}{call}\n"]))
    for at, new in sorted(inserts, reverse=True):
        lines[at:at] = new
    return "".join(lines)


def member(version: str, role: str) -> tuple[str, bytes]:
    """(path, bytes) of a role's file in a release: the newest layout that the wheel has.
    The cached copy serves if it has the sha256 releases/exit_path.tsv gives it; else the
    file is read out of the wheel, checked against the wheel's RECORD, and cached."""
    release = fetch_release.TABLE_ROWS[version]
    tree = os.path.join(fetch_release.cache_dir(), "releases", version)
    try:
        known = fetch_release.exit_paths()[version].role(role)[1]
    except (OSError, ValueError, KeyError):
        known = None  # a release the table does not list yet
    for path in PLACES[role]:
        try:
            with open(os.path.join(tree, path), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        if fetch_release.sha256(data) == known:
            return path, data
    for path in PLACES[role]:
        try:
            data = fetch_release.read_members(release.wheel, [path])[path]
        except KeyError:
            continue
        fetch_release.write_atomically(os.path.join(tree, path), data)
        return path, data
    raise LookupError(f"vllm=={version} has none of {', '.join(PLACES[role])}")


def shape(diff: str) -> str:
    """A diff's text less its seal and hunk headers: the same for releases it serves alike."""
    return "".join(line for line in diff.splitlines(keepends=True)[1:] if not line.startswith("@@"))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--helper"]:
        with open(args[1], encoding="utf-8") as f:
            text = f.read()
        with open(HELPER_DIFF, "w", encoding="utf-8") as f:
            f.write(creation_diff(text, HELPER_PATH))
        args = args[2:]
    if args:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 6
    rows = []
    diffs: dict[str, dict[str, tuple[str, str]]] = {role: {} for role in ROLES}  # role -> shape -> (name, diff)
    for version in fetch_release.RELEASES:
        row = [version]
        for role in ROLES:
            path, data = member(version, role)
            text = data.decode("utf-8")
            fixed = hooked(text, role)
            diff = make_diff(text, fixed, path, whole_functions=False)
            name, _ = diffs[role].setdefault(shape(diff), (f"v{version}.diff", diff))
            row += [path, name, fetch_release.sha256(data), fetch_release.sha256(fixed.encode("utf-8"))]
        rows.append(row)
    for role in ROLES:
        directory = os.path.join(HERE, "patches", role)
        for old in os.listdir(directory):
            os.unlink(os.path.join(directory, old))
        for name, diff in diffs[role].values():
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                f.write(diff)
    body = ("# The set's other files: for each release, the diff of the API server's launcher and server file\n"
            "# (its exit path, issue 35) and of the message queue (its heartbeat, issue 46), in patches/ROLE/;\n"
            "# each file's path, and its sha256 before and after.\n"
            "# Written by scripts/make_exit_diffs.py; apply.py applies them with the executor's diff.\n"
            + "\t".join(EXIT_PATH_COLUMNS) + "\n" + "".join("\t".join(row) + "\n" for row in rows))
    with open(fetch_release.EXIT_PATH_TABLE, "w", encoding="utf-8") as f:
        f.write(seal(body))
    for role in ROLES:
        print(f"{role}: {len(diffs[role])} diffs for {len(rows)} releases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
