"""Add a vLLM release to the bundle: one command, minutes instead of a day.

    python3 scripts/new_release.py VERSION [--write] [--bundle DIR]

1. Reads the release's multiproc_executor.py out of its wheel (fetch_release.survey:
   the table row less its diff and fixed_sha256; the file is cached).
2. Finds the release of releases/releases.tsv whose file differs from it in the fewest
   lines, and says what changed against it, by area (read with ast): the worker loop,
   the executor's read path (FutureWrapper, collective_rpc's reads and what the future
   is built with), the worker monitor, and everything else in one line.
3. Fit: a diff that fits the file exactly (apply.py --exact --check) is the row's
   diff. Else the nearest diff is placed by adaptation, as apply.py does; then a new
   diff, patches/vVERSION.diff, is made of the fixed file with make_diff.py. Either
   way the fixed file passes the loop test (test_rank_exception_fatal.py, as CI runs
   it) and the diff passes git apply --check and patch -p1 -F0 --dry-run on the
   release's file. When the read path or the worker loop gained a function or an
   argument (a new FutureWrapper method: the loop test does not call it), or no diff
   can be placed, the release needs a diff of its own: it prints the commands.
4. --write writes the diff and the table row (both sha256s), and seals the table
   (make_diff.py --table), each through a temporary file and a rename; without it,
   it prints what it would write.

Exit status: 0 ready (an exact fit, or a new diff proven), 1 needs a hand-made diff
(what to do is printed), 2 error (one line).

--bundle DIR (default $RANK_EXCEPTION_FATAL_BUNDLE, else this repo): the bundle whose
apply.py, patches/, releases/ and loop test are used and written (a copy, for tests).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import namedtuple
from collections.abc import Sequence

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # the bundle's package, the other scripts

import fetch_release  # noqa: E402
from make_diff import make_diff, seal_table  # noqa: E402
from rank_exception_fatal.adapt import adapt, adapted_words  # noqa: E402
from rank_exception_fatal.bundle import diff_names, parse_fix  # noqa: E402
from rank_exception_fatal.outcome import TARGET  # noqa: E402
from rank_exception_fatal.table import COLUMNS, Release, read_releases  # noqa: E402

READY, NEEDS_HAND_DIFF, ERROR = 0, 1, 2

# The areas the fix lives in, by qualified name (Class.method.nested).
LOOP_METHODS = {"worker_busy_loop", "_execute_worker_rpc", "handle_output", "enqueue_output"}
MONITOR_METHODS = {"start_worker_monitor", "shutdown"}
AREAS = ("worker loop", "read path", "monitor")


class Stop(Exception):
    """An error: one line on stderr, exit 2."""


# --- the bundle's paths -------------------------------------------------------------


def bundle_path(bundle: str, *parts: str) -> str:
    return os.path.join(bundle, *parts)


def table_path(bundle: str) -> str:
    return bundle_path(bundle, "releases", "releases.tsv")


# --- 1. the release's file ----------------------------------------------------------


def surveyed(version: str) -> tuple[Release, str]:
    """(the row, with diff and fixed_sha256 empty; the path of the cached file)."""
    version_, digest, fault_tolerance, wheel, sdist = fetch_release.survey(version).split("\t")
    path = os.path.join(fetch_release.cache_dir(), "releases", version, TARGET)
    return Release(version_, "", digest, "", fault_tolerance, wheel, sdist), path


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


# --- 2. the nearest release and what changed ----------------------------------------


def differing_lines(old: str, new: str) -> int:
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


def nearest_release(text: str, table: dict[str, Release]) -> tuple[Release, str, int]:
    """(the release whose file differs least from text, its text, how many lines); of
    equals, the newest. Each distinct file is read once (fetched if not cached)."""
    newest_by_file = {release.sha256: release for release in table.values()}
    best = None
    for release in reversed(list(newest_by_file.values())):  # newest first: ties keep it
        tree = fetch_release.unlisted_release_tree(release.version, release.sha256)
        old = read_text(os.path.join(tree, TARGET))
        count = differing_lines(old, text)
        if best is None or count < best[2]:
            best = (release, old, count)
    if best is None:
        raise Stop("releases/releases.tsv lists no release to compare with")
    return best


def functions(source: str) -> dict[str, ast.AST]:
    """Every function by qualified name (Class.method.nested)."""
    found: dict[str, ast.AST] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    while name in found:  # the same name defined twice (in two branches)
                        name += "'"
                    found[name] = child
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def area(qualname: str) -> str | None:
    parts = qualname.split(".")
    if parts[0] == "WorkerProc" and len(parts) > 1 and (parts[1] in LOOP_METHODS or "async_output" in parts[1]):
        return "worker loop"
    if parts[0] == "FutureWrapper" or parts[:2] == ["MultiprocExecutor", "collective_rpc"]:
        return "read path"
    if parts[0] == "MultiprocExecutor" and len(parts) > 1 and parts[1] in MONITOR_METHODS:
        return "monitor"
    return None


def argument_names(node: ast.AST) -> list[str]:
    args = node.args
    every = [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs,
             *([args.kwarg] if args.kwarg else [])]
    return [a.arg for a in every]


def future_arguments(source: str) -> set[str]:
    """The keyword arguments of every FutureWrapper(...) call: what the future is built with."""
    return {keyword.arg for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "FutureWrapper" for keyword in node.keywords if keyword.arg}


def statements(source: str) -> dict[str, str]:
    """What is not a function, by owner: the imports, each top-level name assigned, the
    rest of the module's code, each class's own statements (its attributes)."""
    found: dict[str, list[str]] = {}

    def add(key: str, node: ast.AST) -> None:
        found.setdefault(key, []).append(ast.dump(node))

    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            add("imports", node)
        elif isinstance(node, ast.ClassDef):
            add(f"class {node.name}", ast.ClassDef(node.name, node.bases, node.keywords, [], node.decorator_list))
            for member in node.body:
                if not isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    add(f"class {node.name}", member)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            add(", ".join(ast.unparse(t) for t in targets), node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add("module code", node)
    return {key: "\n".join(dumps) for key, dumps in found.items()}


# added, removed, changed: qualified names; arguments: {qualname: new argument names}
Change = namedtuple("Change", "added removed changed arguments")


def changes(old: str, new: str) -> tuple[dict[str, Change], list[str]]:
    """({area: Change}, what else changed: names and statements), old -> new."""
    before, after = functions(old), functions(new)
    by_area = {name: Change([], [], [], {}) for name in (*AREAS, None)}
    for name in sorted(set(before) | set(after), key=lambda n: (n not in after, n)):
        change = by_area[area(name)]
        if name not in before:
            change.added.append(name)
        elif name not in after:
            change.removed.append(name)
        elif ast.dump(before[name]) != ast.dump(after[name]):
            change.changed.append(name)
            new_arguments = [a for a in argument_names(after[name]) if a not in argument_names(before[name])]
            if new_arguments:
                change.arguments[name] = new_arguments
    new_keywords = sorted(future_arguments(new) - future_arguments(old))
    if new_keywords:
        by_area["read path"].arguments["FutureWrapper(...)"] = new_keywords
    old_statements, new_statements = statements(old), statements(new)
    elsewhere = by_area.pop(None)
    other = [f"{name} (added)" for name in elsewhere.added] + [f"{name} (removed)" for name in elsewhere.removed]
    other += elsewhere.changed + sorted(key for key in set(old_statements) | set(new_statements)
                                        if old_statements.get(key) != new_statements.get(key))
    return by_area, other


def describe(change: Change) -> str:
    parts = [f"{word} {', '.join(names)}" for word, names in
             (("added", change.added), ("removed", change.removed), ("changed", change.changed)) if names]
    parts += [f"{name} takes new arguments {', '.join(args)}" for name, args in change.arguments.items()]
    return "; ".join(parts) or "unchanged"


def unproven(by_area: dict[str, Change]) -> list[str]:
    """What the bundle's loop test may not drive: a function new to (or gone from) the read
    path or the worker loop, such as a FutureWrapper method a caller may read through
    instead of result(), or an argument new to one of them or to the future."""
    found = []
    for name in ("read path", "worker loop"):
        change = by_area[name]
        if change.added:
            found.append(f"new in the {name}: {', '.join(change.added)}")
        if change.removed:
            found.append(f"gone from the {name}: {', '.join(change.removed)}")
        for function, args in change.arguments.items():
            found.append(f"{function} takes new arguments: {', '.join(args)}")
    return found


# --- 3. fit, fix, prove ---------------------------------------------------------------


def run(command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, **kwargs)


def copy_tree(release_file: str, root: str) -> str:
    """A tree at root holding vllm/ with the release's file; the path of that file."""
    path = os.path.join(root, TARGET)
    os.makedirs(os.path.dirname(path))
    shutil.copyfile(release_file, path)
    return path


def exact_fit(bundle: str, release_file: str, work: str) -> str | None:
    """The diff that fits the file exactly, or None (apply.py --exact --check)."""
    root = os.path.join(work, "exact")
    copy_tree(release_file, root)
    # The executor's diff is what this script makes: the exit path's files are not in the tree.
    done = run([sys.executable, bundle_path(bundle, "apply.py"), "--root", root, "--exact", "--check", "--json",
                "--executor-only"])
    try:
        report = json.loads(done.stdout)
    except ValueError:
        raise Stop(f"apply.py --exact --check exited {done.returncode}: {done.stderr.strip()[-300:]}") from None
    if done.returncode == 1 and report.get("diff") and not report.get("adapted"):
        return report["diff"]
    if done.returncode == 2:
        return None
    raise Stop(f"apply.py --exact --check on the release's file: {report.get('state')}: {report.get('message')}")


def placed(bundle: str, text: str):
    """The Adaptation apply.py would make of the bundle's diffs on this text, or None."""
    directory = bundle_path(bundle, "patches")
    fixes = [parse_fix(name, read_text(os.path.join(directory, name))) for name in diff_names(directory)]
    return adapt(text, fixes)


def fixed_file(bundle: str, release_file: str, root: str) -> bytes:
    """The file apply.py --root makes of the release's in a tree at root (an adapted fix
    is proven before it is written)."""
    path = copy_tree(release_file, root)
    done = run([sys.executable, bundle_path(bundle, "apply.py"), "--root", root, "--executor-only"])
    if done.returncode != 0:
        raise Stop(f"apply.py --root on a copy of the release exited {done.returncode}: "
                   + (done.stderr or done.stdout).strip().splitlines()[0])
    with open(path, "rb") as f:
        return f.read()


def loop_test(bundle: str, root: str, fault_tolerance: str) -> str | None:
    """None if the bundle's loop test passes on the tree, as CI runs it; else its tail."""
    env = {**os.environ, "GAUDI_FIXES_ROOT": root, "RANK_EXCEPTION_FATAL_FAULT_TOLERANCE": fault_tolerance}
    done = run([sys.executable, "-m", "unittest", "-v", "test_rank_exception_fatal"], cwd=bundle, env=env, timeout=600)
    if done.returncode == 0 and re.search(r"^OK$", done.stderr, re.M):
        return None
    return " / ".join(done.stderr.strip().splitlines()[-3:])


def stock_tools(diff_path: str, release_file: str, fixed: bytes, work: str, *, own: bool) -> str | None:
    """None if git apply --check and patch -p1 -F0 --dry-run take the diff on the release's
    file without fuzz (nor offset, if it is the release's own diff), and git apply makes
    the fixed file of it; else why not, in one line."""
    root = os.path.join(work, "stock")
    path = copy_tree(release_file, root)
    checked = run(["git", "apply", "--check", "-p1", diff_path], cwd=root)
    if checked.returncode:
        return "git apply --check: " + " / ".join(checked.stderr.strip().splitlines())
    dry = run(["patch", "-p1", "-F0", "--dry-run", "-i", diff_path], cwd=root)
    said = dry.stdout + dry.stderr
    if dry.returncode or "fuzz" in said or (own and "offset" in said):
        return "patch -p1 -F0 --dry-run: " + " / ".join(said.strip().splitlines())
    applied = run(["git", "apply", "-p1", diff_path], cwd=root)
    with open(path, "rb") as f:
        if applied.returncode or f.read() != fixed:
            return "git apply does not make the fixed file of the release's"
    return None


# --- 4. write -------------------------------------------------------------------------


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def row_line(release: Release) -> str:
    return "\t".join(getattr(release, column) for column in COLUMNS)


def table_with(text: str, release: Release) -> str:
    """The table's text, less its seal, with the row in version order."""
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("# sha256 of the lines below: "):
        lines = lines[1:]
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    at = len(lines)
    for k, line in enumerate(lines):
        fields = line.split("\t")
        if not line.startswith("#") and len(fields) == len(COLUMNS) and fields[0] != "version" \
                and version_key(fields[0]) > version_key(release.version):
            at = k
            break
    return "".join(lines[:at] + [row_line(release) + "\n"] + lines[at:])


def temp_beside(path: str, text: str) -> str:
    """A temporary file beside path holding text, with path's mode."""
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".new-release-")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.chmod(temp, os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o644)
    return temp


def write(bundle: str, release: Release, table_text: str, diff_text: str | None) -> None:
    """The diff (if new) and the table, each through a temporary file and a rename; the
    table sealed (make_diff.py --table) and read back whole before either is renamed."""
    table, diff = table_path(bundle), bundle_path(bundle, "patches", release.diff)
    temps = [temp_beside(table, table_text)]
    try:
        seal_table(temps[0])
        read_releases(read_text(temps[0]), [*diff_names(bundle_path(bundle, "patches")), release.diff])
        if diff_text is not None:
            temps.append(temp_beside(diff, diff_text))
            os.replace(temps.pop(), diff)
            print(f"wrote patches/{release.diff}")
        os.replace(temps.pop(0), table)
        print(f"wrote releases/releases.tsv (sealed): {row_line(release)}")
    finally:
        for temp in temps:
            os.unlink(temp)


# --- what it says -----------------------------------------------------------------


def hand_diff_steps(bundle: str, release: Release, release_file: str, nearest: Release, adaptation) -> list[str]:
    version = release.version
    edited = os.path.join(fetch_release.cache_dir(), "edited", f"v{version}")
    tree = release_file[: -len(TARGET) - 1]
    steps = [f"mkdir -p {edited} && cp -r {tree}/vllm {edited}/"]
    if adaptation is not None:
        steps.append(f"python3 apply.py --root {edited} --executor-only    # a start: {adaptation.fix.name}, adapted and proven")
    steps += [
        f"$EDITOR {edited}/{TARGET}    # the fix of patches/{nearest.diff}, carried to what changed (above)",
        f"python3 scripts/make_diff.py {release_file} {edited}/{TARGET} > patches/v{version}.diff",
        f"python3 scripts/new_release.py {version} --write    # now an exact fit: proves it, writes the row, seals the table",
        "python3 scripts/supersede.py",
        f"python3 -m pytest tests/test_releases.py -k {version}",
    ]
    return [f"needs a diff of its own: edit a copy, then make_diff (in {bundle}):"] + [f"  {s}" for s in steps]


def next_steps(version: str) -> list[str]:
    return [f"then: add {version} to docs/releases.md's table and README's summary (tests/test_releases.py checks both),",
            f"  python3 -m pytest tests/test_releases.py -k {version}"]


# --- the command ---------------------------------------------------------------------


def report(release: Release, nearest: Release, count: int, by_area: dict[str, Change], other: list[str]) -> None:
    print(f"vllm {release.version}: sha256 {release.sha256}, {release.wheel}, sdist {release.sdist},"
          f" enable_fault_tolerance {release.fault_tolerance}")
    print(f"nearest in the table: {nearest.version} (patches/{nearest.diff}), {count} lines differ")
    print(f"changed against {nearest.version}:")
    for name in AREAS:
        print(f"  {name}: {describe(by_area[name])}")
    print(f"  elsewhere: {', '.join(other) or 'nothing'}")


def fit(bundle: str, release: Release, release_file: str, text: str, nearest: Release, by_area: dict[str, Change],
        work: str) -> tuple[str, bool] | None:
    """(the diff, whether it is new) if the bundle can fix the release; None, with the
    commands printed, if it needs a hand-made diff."""
    diff = exact_fit(bundle, release_file, work)
    if diff:
        print(f"fits patches/{diff} exactly: add the row with that diff")
        return diff, False
    adaptation = placed(bundle, text)
    print("no diff fits exactly; " + (f"patches/{adaptation.fix.name} is placed by adaptation ({adapted_words(adaptation)})"
                                      if adaptation else "no diff can be placed by adaptation either"))
    problems = unproven(by_area)
    for problem in problems:
        print(f"the bundle's loop test may not drive this: {problem}")
    if adaptation is None or problems:
        print("\n".join(hand_diff_steps(bundle, release, release_file, nearest, adaptation)))
        return None
    diff = f"v{release.version}.diff"
    if os.path.exists(bundle_path(bundle, "patches", diff)):
        raise Stop(f"patches/{diff} exists but does not fit vllm {release.version} exactly: make it again with make_diff.py")
    return diff, True


def fix_and_prove(bundle: str, release: Release, release_file: str, text: str, diff: str, new: bool,
                  work: str) -> tuple[bytes, str | None]:
    """(the fixed file, the new diff's text or None): apply.py --root makes the fixed file,
    make_diff.py the new diff; the loop test passes on the fixed file and the stock tools
    take the diff on the release's. Stop if not."""
    fixed_root = os.path.join(work, "fixed")
    fixed = fixed_file(bundle, release_file, fixed_root)
    if fixed.decode("utf-8") == text:
        raise Stop(f"apply.py changes nothing in vllm {release.version}'s file: it needs no row")
    diff_text, diff_path = None, bundle_path(bundle, "patches", diff)
    if new:
        diff_text, diff_path = make_diff(text, fixed.decode("utf-8")), os.path.join(work, diff)
        with open(diff_path, "w", encoding="utf-8", newline="") as f:
            f.write(diff_text)
    failed = loop_test(bundle, fixed_root, release.fault_tolerance)
    if failed:
        raise Stop(f"the loop test fails on the fixed file: {failed}")
    print(f"proven: the loop test passes on the fixed file (enable_fault_tolerance {release.fault_tolerance})")
    failed = stock_tools(diff_path, release_file, fixed, work, own=diff == f"v{release.version}.diff")
    if failed:
        raise Stop(f"patches/{diff} on the release's file: {failed}")
    print(f"patches/{diff}: git apply --check and patch -p1 -F0 --dry-run take it on the release's file")
    return fixed, diff_text


def write_or_show(bundle: str, release: Release, diff_text: str | None, writing: bool) -> None:
    new_table = table_with(read_text(table_path(bundle)), release)
    if not writing:
        if diff_text is not None:
            print(f"would write patches/{release.diff} ({diff_text.count(chr(10))} lines,"
                  f" {diff_text.count(chr(10) + '@@ ')} hunks)")
        print(f"would add to releases/releases.tsv and seal it: {row_line(release)}")
        print("run again with --write to write it")
        return
    write(bundle, release, new_table, diff_text)


def new_release(version: str, bundle: str, writing: bool) -> int:
    table = fetch_release.read_table(table_path(bundle))
    if version in table:
        raise Stop(f"vllm=={version} is already in releases/releases.tsv (patches/{table[version].diff})")
    release, release_file = surveyed(version)
    text = read_text(release_file)
    nearest, nearest_text, count = nearest_release(text, table)
    by_area, other = changes(nearest_text, text)
    report(release, nearest, count, by_area, other)
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-new-release-") as work:
        fitted = fit(bundle, release, release_file, text, nearest, by_area, work)
        if fitted is None:
            return NEEDS_HAND_DIFF
        fixed, diff_text = fix_and_prove(bundle, release, release_file, text, *fitted, work)
    release.diff, release.fixed_sha256 = fitted[0], hashlib.sha256(fixed).hexdigest()
    write_or_show(bundle, release, diff_text, writing)
    print("\n".join(next_steps(version)))
    return READY


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="new_release.py", description=__doc__.strip().splitlines()[0])
    parser.add_argument("version")
    parser.add_argument("--write", action="store_true", help="write the diff and the table row")
    parser.add_argument("--bundle", default=os.environ.get("RANK_EXCEPTION_FATAL_BUNDLE") or os.path.dirname(SCRIPTS),
                        help="the bundle to read and write (default: this repo)")
    args = parser.parse_args(argv)
    try:
        return new_release(args.version, os.path.abspath(args.bundle), args.write)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, no traceback: Stop, and what fetching, reading or a child raised
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"new_release.py: {message}", file=sys.stderr)
        return ERROR


if __name__ == "__main__":
    raise SystemExit(main())
