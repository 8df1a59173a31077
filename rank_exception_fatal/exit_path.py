"""The API server's exit path (docs/supervisor.md §3): the helper module, the launcher and
the server file of a tree, each decided by its sha256 against releases/exit_path.tsv, and
written in dependency order: fixed, or given back their release's bytes.

Exact only: a launcher or server file the table does not know is drift, nothing is
adapted, and the two must be one release's. Not run by apply.py's modes yet."""
from __future__ import annotations

import os

from . import bundle
from .bundle import check_integrity, parse_fix, read_table_text
from .match import rewrite, split_lines
from .outcome import APPLIED_STATE, BAD_BUNDLE, CHANGED_AFTER_WRITE, DRIFTED_STATE, NOT_APPLIED_STATE, Failure
from .seal import sha256_hex
from .table import ROLES, ExitPath, read_exit_paths, read_releases

HELPER = "vllm/entrypoints/_rank_exception_fatal.py"
HELPER_DIFF = "helper/helper.diff"
EXIT_PATH_TABLE = os.path.join(bundle.HERE, "releases", "exit_path.tsv")
# Apply writes in this order, and the executor after them; revert in the reverse order,
# the helper removed last: a fixed file's import is in place whenever the file is.
WRITE_ORDER = ("helper", *ROLES)


class Part:
    """One file of the exit path in a tree: its role; its path within the tree; its bytes
    (None: absent, as the helper is until apply creates it); its state; the diff that fixes
    it, under patches/; its bytes fixed and released (None: the helper's release side is
    its absence); the releases whose file it is (both sides); why it drifted. (A plain
    class: see outcome.Report.)"""

    __slots__ = ("role", "path", "data", "state", "diff", "fixed", "released", "versions", "why")

    def __init__(self, role: str, path: str, data: bytes | None, state: str, *, diff: str | None = None,
                 fixed: bytes | None = None, released: bytes | None = None, versions: frozenset = frozenset(),
                 why: str | None = None) -> None:
        self.role, self.path, self.data, self.state, self.diff = role, path, data, state, diff
        self.fixed, self.released, self.versions, self.why = fixed, released, versions, why

    def __repr__(self) -> str:
        return f"Part({self.role!r}, {self.path!r}, {self.state!r})"

    def wanted(self, revert: bool) -> bytes | None:
        return self.released if revert else self.fixed


def read_exit_table() -> dict[str, ExitPath]:
    """version -> ExitPath, once releases/exit_path.tsv is whole and lists the release table's releases."""
    try:
        with open(EXIT_PATH_TABLE, encoding="utf-8", newline="") as f:
            text = f.read()
        return read_exit_paths(text, read_releases(read_table_text()))
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read {EXIT_PATH_TABLE}: {e}; copy the bundle again") from None
    except ValueError as e:
        raise Failure(BAD_BUNDLE, f"releases/exit_path.tsv {e}") from None


def read_diff(name: str) -> str:
    """The diff patches/NAME as it is, seal included."""
    try:
        with open(os.path.join(bundle.PATCHES_DIR, name), encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read patches/{name}: {e}; copy the bundle again") from None


def diff_target(text: str) -> str | None:
    """The path a diff writes, from its +++ line."""
    return next((line[len("+++ b/"):] for line in text.splitlines() if line.startswith("+++ b/")), None)


def helper_bytes() -> bytes:
    """The helper module as patches/helper/helper.diff creates it."""
    from unidiff import PatchSet

    body = check_integrity(HELPER_DIFF, read_diff(HELPER_DIFF))
    try:
        [created] = PatchSet(body)
        [hunk] = created
    except Exception:  # unidiff raises more than UnidiffParseError on odd input; or not one file, one hunk
        created = None
    if created is None or not created.is_added_file or created.path != HELPER:
        raise Failure(BAD_BUNDLE, f"patches/{HELPER_DIFF} is not the creation of {HELPER}: copy the bundle again")
    return "".join(line.value for line in hunk.target_lines()).encode("utf-8")


def read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        from .outcome import CANNOT_READ_OR_WRITE

        raise Failure(CANNOT_READ_OR_WRITE, f"cannot read {path}: {e.strerror}") from None


def read_helper(tree: str) -> Part:
    data, fixed = read_file(os.path.join(tree, HELPER)), helper_bytes()
    if data is None:
        return Part("helper", HELPER, None, NOT_APPLIED_STATE, diff=HELPER_DIFF, fixed=fixed)
    if data == fixed:
        return Part("helper", HELPER, data, APPLIED_STATE, diff=HELPER_DIFF, fixed=fixed)
    return Part("helper", HELPER, data, DRIFTED_STATE, diff=HELPER_DIFF,
                why=f"{HELPER} holds other bytes than patches/{HELPER_DIFF} creates")


def read_role(tree: str, role: str, rows: dict[str, ExitPath]) -> Part:
    """The role's file: the one of its paths (every diff's of the role) whose sha256 the table
    lists, decided by it, with both of its sides made by the diff and checked against the table."""
    known: dict[str, tuple[str, str, set]] = {}  # sha256 -> (state, diff, versions)
    paths: dict[str, str] = {}  # diff -> the path it writes
    for version, row in rows.items():
        diff, release_sha256, fixed_sha256 = row.role(role)
        for digest, state in ((release_sha256, NOT_APPLIED_STATE), (fixed_sha256, APPLIED_STATE)):
            entry = known.setdefault(digest, (state, diff, set()))
            if entry[:2] != (state, diff):
                raise Failure(BAD_BUNDLE, f"releases/exit_path.tsv gives the {role} file {digest} to two diffs or sides")
            entry[2].add(version)
        paths.setdefault(diff, "")
    texts = {diff: read_diff(diff) for diff in paths}
    for diff, text in texts.items():
        paths[diff] = diff_target(text) or ""
    found = []
    for path in sorted(set(paths.values())):
        data = read_file(os.path.join(tree, path))
        if data is not None:
            found.append((path, data, known.get(sha256_hex(data))))
    matched = [(path, data, entry) for path, data, entry in found if entry is not None]
    if len(matched) != 1:
        where = sorted(set(paths.values()))[0] if not found else found[0][0]
        why = (f"two {role} files of releases stand in the tree ({', '.join(p for p, _, _ in matched)})" if matched
               else f"{where} is no release's {role} file this bundle knows" if found
               else f"no {role} file at {' or '.join(sorted(set(paths.values())))}")
        return Part(role, where, found[0][1] if found else None, DRIFTED_STATE, why=why)
    path, data, (state, diff, versions) = matched[0]
    fix = parse_fix(diff, texts[diff], target=path)
    other = rewrite(split_lines(data.decode("utf-8")), fix, revert=state == APPLIED_STATE).encode("utf-8")
    row = rows[next(iter(versions))]
    _, release_sha256, fixed_sha256 = row.role(role)
    released, fixed = (other, data) if state == APPLIED_STATE else (data, other)
    if (sha256_hex(released), sha256_hex(fixed)) != (release_sha256, fixed_sha256):
        raise Failure(BAD_BUNDLE, f"patches/{diff} does not make the {role} file releases/exit_path.tsv records")
    return Part(role, path, data, state, diff=diff, fixed=fixed, released=released, versions=frozenset(versions))


def read_exit_path(tree: str) -> list[Part]:
    """The exit path's files in the tree holding vllm/, in write order. The launcher and
    the server file must be one release's: a launcher of one release with the server of
    another was never tested together, and both drift."""
    rows = read_exit_table()
    parts = [read_helper(tree) if role == "helper" else read_role(tree, role, rows) for role in WRITE_ORDER]
    launcher, server = (next(part for part in parts if part.role == role) for role in ROLES)
    if launcher.versions and server.versions and not launcher.versions & server.versions:
        why = (f"{launcher.path} is vllm {sorted(launcher.versions)[0]}'s and {server.path} another release's"
               f" (vllm {sorted(server.versions)[0]}): files of two releases")
        for part in (launcher, server):
            part.state, part.why = DRIFTED_STATE, why
    return parts


def write_exit_path(tree: str, *, revert: bool, pycache_prefix: str | None = None) -> list[Part]:
    """Write every file not on the wanted side yet, in write order (reversed to revert: the
    helper is removed last), each durable before the next; under the lock on vllm/. The
    files as they were before, once each is read back as written. Nothing is written if
    any file drifted: the caller reports the drift (Part.why)."""
    from .disk import DirectoryLock, leftover_temp_files, remove_file, remove_files, replace_file

    with DirectoryLock(os.path.join(tree, "vllm")):
        parts = read_exit_path(tree)
        if any(part.state == DRIFTED_STATE for part in parts):
            return parts
        # A created file takes the owner and mode of the server file.
        like = os.path.join(tree, next(part.path for part in parts if part.role == "server"))
        for part in reversed(parts) if revert else parts:
            path = os.path.join(tree, part.path)
            remove_files(leftover_temp_files(os.path.dirname(path)))  # from a run that was killed
            wanted = part.wanted(revert)
            if part.data == wanted:
                continue
            if wanted is None:
                remove_file(path)
            else:
                replace_file(path, wanted, like=None if part.data is not None else like)
            remove_files(bytecode_of(tree, part.path, pycache_prefix))  # an unchecked-hash .pyc would run the other side
            if read_file(path) != wanted:
                raise Failure(CHANGED_AFTER_WRITE, f"wrote {path}, then read back other bytes: another program changed it; run again")
    return parts


def bytecode_of(tree: str, relative: str, pycache_prefix: str | None) -> list[str]:
    """Every cached .pyc of the tree's file at relative."""
    from .bytecode import bytecode_files

    path = os.path.join(tree, relative)
    return bytecode_files(sorted({path, os.path.realpath(path)}), pycache_prefix, tail=os.path.dirname(relative))
