"""The release tables: releases/releases.tsv, and releases/superseded.tsv (the files earlier
bundles made); their one reader, for apply.py and the scripts alike."""

from .seal import DAMAGED, HEADER, unsealed

# Sequence is for annotations only: importing collections.abc costs the gate 2 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

# The table's columns, in order.
COLUMNS = ("version", "diff", "sha256", "fixed_sha256", "fault_tolerance", "wheel", "sdist")


class Release:
    """A row of the table: the version; the diff in patches/ that fixes it; the sha256 of
    its TARGET and of the file the diff makes of it (--check decides a known file by
    these two); whether its parallel config has enable_fault_tolerance (yes/no); the
    wheel the file is read from; whether the sdist holds the same bytes
    (same/differs/none). (A plain class: see outcome.Report.)"""

    __slots__ = COLUMNS

    def __init__(self, version: str, diff: str, sha256: str, fixed_sha256: str, fault_tolerance: str, wheel: str,
                 sdist: str) -> None:
        self.version, self.diff, self.sha256, self.fixed_sha256 = version, diff, sha256, fixed_sha256
        self.fault_tolerance, self.wheel, self.sdist = fault_tolerance, wheel, sdist

    def __repr__(self) -> str:
        return f"Release({self.version!r}, {self.diff!r})"

HEX_DIGITS = "0123456789abcdef"


def sha256_digests(digests: "Sequence[str]") -> bool:
    """Whether each is a sha256 as the tables write it: 64 lowercase hex digits. (Over all
    of them at once: bytes.fromhex is C; str.strip over a table's digits costs the gate
    tens of microseconds. fromhex skips whitespace, which the length then tells.)"""
    joined = "".join(digests)
    try:
        return (set(map(len, digests)) <= {64} and len(bytes.fromhex(joined)) * 2 == len(joined)
                and joined == joined.lower())
    except ValueError:
        return False


def read_releases(table: str, diffs: "Sequence[str] | None" = None, *, sealed: bool = True) -> dict[str, Release]:
    """version -> Release, from the table's text, oldest first. ValueError saying what is
    wrong if the table is not whole or contradicts itself: its first line is the sha256 of
    the rest, as a diff's is (scripts/make_diff.py --table writes it); each row's fixed
    file differs from its release's and from every release's, no version is listed
    twice, a file is one diff's, and each diff it names is among diffs (when given).
    sealed=False: for the scripts that edit it, a table whose seal is not written yet.
    One pass: the deploy gate reads the table on every run."""
    rows = checked_rows(table, COLUMNS, sealed=sealed, writer="scripts/make_diff.py --table")
    if release_rows_agree(rows, diffs):  # the gate's case: each check over a whole column at once
        return {row[0]: Release(*row) for row in rows}
    releases: dict[str, Release] = {}  # the first row at fault, named
    owner: dict[str, tuple[str, str]] = {}  # sha256 -> (diff, side)
    for row in rows:
        release = Release(*row) if len(row) == len(COLUMNS) else None
        problem = row_problem(release, row, releases, owner, diffs)
        if problem:
            raise ValueError(problem)
        releases[release.version] = release
    return releases


def checked_rows(table: str, columns: tuple[str, ...], *, sealed: bool, writer: str) -> list[list[str]]:
    """A table's rows, once its seal (unless not sealed yet) and its columns are right;
    ValueError saying what is wrong, and which script writes it, otherwise."""
    _, broken = unsealed(table) if sealed else (None, None)
    if broken == DAMAGED:
        raise ValueError("is cut short or damaged (its sha256 differs): copy the bundle again")
    if broken:
        raise ValueError(f"does not start with {HEADER.strip()!r}: write it with {writer}")
    header, rows = table_rows(table)
    if tuple(header) != columns:
        raise ValueError(f"must have the columns {' '.join(columns)}")
    return rows


def table_rows(table: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows): tab-separated; # starts a comment (the seal is one)."""
    header, *rows = [line.split("\t") for line in table.splitlines() if line.strip() and not line.startswith("#")] or [[]]
    return header, rows


def release_rows_agree(rows: list[list[str]], diffs: "Sequence[str] | None") -> bool:
    """Whether no row has a problem row_problem would name, by column (as exit_rows_well_formed)."""
    if not rows or {len(row) for row in rows} != {len(COLUMNS)}:
        return not rows
    versions, names, sha256s, fixed_sha256s, fault_tolerance, _, sdists = zip(*rows)
    return (sha256_digests(sha256s + fixed_sha256s) and {*fault_tolerance} <= {"yes", "no"}
            and {*sdists} <= {"same", "differs", "none"} and len(set(versions)) == len(versions)
            # a file is one side's (a release's own fixed file included), and one diff's
            and set(sha256s).isdisjoint(fixed_sha256s) and len(set(zip(sha256s, names))) == len(set(sha256s))
            and len(set(zip(fixed_sha256s, names))) == len(set(fixed_sha256s))
            and (diffs is None or set(names) <= set(diffs)))


def table_problem(table: str, diffs: "Sequence[str] | None" = None, *, sealed: bool = True) -> "str | None":
    """What is wrong with the release table's text (read_releases says what it checks), if anything."""
    try:
        read_releases(table, diffs, sealed=sealed)
    except ValueError as e:
        return str(e)
    return None


def row_problem(release: "Release | None", row: list[str], seen: dict[str, Release], owner: dict[str, tuple[str, str]],
                diffs: "Sequence[str] | None") -> "str | None":
    if (release is None or not sha256_digests((release.sha256, release.fixed_sha256))
            or release.fault_tolerance not in ("yes", "no") or release.sdist not in ("same", "differs", "none")):
        return f"has a malformed row: {row[0]!r}"
    if release.version in seen:
        return f"lists {release.version} twice"
    if release.fixed_sha256 == release.sha256:
        return f"gives {release.version} a fixed_sha256 equal to its sha256: the release would read as applied"
    if diffs is not None and release.diff not in diffs:
        return f"names {release.diff} for {release.version}, which is not in patches/: copy the bundle again"
    for digest, side in ((release.sha256, "release"), (release.fixed_sha256, "fixed")):
        if owner.setdefault(digest, (release.diff, side)) != (release.diff, side):
            return f"row {release.version}: {digest} is already another diff's or the other side's file"
    return None


# The earlier fixes table (releases/superseded.tsv): its columns, in order.
EARLIER_COLUMNS = ("version", "diff", "sha256", "fixed_sha256")


class EarlierFix:
    """A row of releases/superseded.tsv: a file an earlier bundle's diff made of a release
    (or of a build between releases) and this bundle's does not. The release's version
    (or the build's name); the earlier diff, in patches/superseded/; the sha256 of the
    release's file, which that diff taken back gives; the sha256 of the file it made. (A
    plain class: see outcome.Report.)"""

    __slots__ = EARLIER_COLUMNS

    def __init__(self, version: str, diff: str, sha256: str, fixed_sha256: str) -> None:
        self.version, self.diff, self.sha256, self.fixed_sha256 = version, diff, sha256, fixed_sha256

    def __repr__(self) -> str:
        return f"EarlierFix({self.version!r}, {self.diff!r})"

    @property
    def path(self) -> str:
        """The earlier diff, under patches/."""
        return f"superseded/{self.diff}"


def read_earlier_fixes(table: str, releases: dict[str, Release], diffs: "Sequence[str] | None" = None, *,
                       sealed: bool = True) -> dict[str, EarlierFix]:
    """fixed_sha256 -> EarlierFix, from releases/superseded.tsv's text. ValueError saying
    what is wrong if the table is not whole (sealed as the release table is), gives a
    release of releases another file, gives a file that is a release's or this bundle's
    fixed file, or twice, or a diff not among diffs (when given)."""
    rows = checked_rows(table, EARLIER_COLUMNS, sealed=sealed, writer="scripts/supersede.py")
    current = {digest for release in releases.values() for digest in (release.sha256, release.fixed_sha256)}
    earlier: dict[str, EarlierFix] = {}
    for row in rows:
        fix = EarlierFix(*row) if len(row) == len(EARLIER_COLUMNS) else None
        if fix is None or not sha256_digests((fix.sha256, fix.fixed_sha256)):
            raise ValueError(f"has a malformed row: {row[0]!r}")
        if fix.version in releases and releases[fix.version].sha256 != fix.sha256:
            raise ValueError(f"row {fix.diff}: {fix.version}'s file has another sha256 in releases.tsv")
        if fix.fixed_sha256 in current or fix.fixed_sha256 in earlier:
            raise ValueError(f"row {fix.diff}: {fix.fixed_sha256} is a release's, this bundle's or another row's file")
        if diffs is not None and fix.diff not in diffs:
            raise ValueError(f"names {fix.diff}, which is not in patches/superseded/: copy the bundle again")
        earlier[fix.fixed_sha256] = fix
    return earlier


# The API server's exit path (issue 35, docs/supervisor.md): releases/exit_path.tsv, one
# row a release, made by scripts/make_exit_diffs.py; read by exit_path. Its columns: the
# version, then each role's four, in ROLES' order (a file the set gains is a role more).
ROLES = ("launcher", "server", "queue")
ROLE_FIELDS = ("path", "diff", "sha256", "fixed_sha256")
EXIT_PATH_COLUMNS = ("version", *(f"{role}_{field}" for role in ROLES for field in ROLE_FIELDS))


class ExitPath:
    """A row of releases/exit_path.tsv: the release's version; for each role (the launcher,
    whose terminate_if_errored and stop signal handler the diff hooks, the server file,
    whose run_server it hooks, and the queue, shm_broadcast.py, whose sockets between
    nodes it gives a heartbeat) the file's path in the tree (the diff's target: the
    gate looks there without reading the diffs), the diff in patches/ROLE/, the sha256 of
    the release's file and of the file the diff makes of it. (A plain class: see
    outcome.Report.)"""

    __slots__ = ("version", "files")

    def __init__(self, version: str, *cells: str) -> None:
        self.version = version
        width = len(ROLE_FIELDS)
        self.files = {role: cells[index * width:(index + 1) * width] for index, role in enumerate(ROLES)}

    def __repr__(self) -> str:
        return f"ExitPath({self.version!r}, {', '.join(repr(cells[1]) for cells in self.files.values())})"

    def role(self, role: str) -> "tuple[str, str, str]":
        """(the diff under patches/, the release's sha256, the fixed sha256) for a role."""
        _, diff, sha256, fixed_sha256 = self.files[role]
        return f"{role}/{diff}", sha256, fixed_sha256

    def place(self, role: str) -> str:
        """The role's file's path in the tree (vllm/...), which its diff writes."""
        return self.files[role][0]


def read_exit_paths(table: str, releases: "dict[str, Release] | None", *, sealed: bool = True) -> dict[str, ExitPath]:
    """version -> ExitPath, from releases/exit_path.tsv's text. ValueError saying what is
    wrong if the table is not whole (sealed as the release table is), a row is malformed,
    a version is listed twice, a role's rows contradict each other (a diff given two paths,
    a file given to two diffs or to both sides), or (releases given: for the scripts and tests) the releases
    of the release table and its rows differ. apply.py gives none: a release added to the
    release table before its exit path's row is written has its files placed by the diffs'
    own lines."""
    rows = checked_rows(table, EXIT_PATH_COLUMNS, sealed=sealed, writer="scripts/make_exit_diffs.py")
    if exit_rows_well_formed(rows):  # the gate's case: each check over a whole column at once
        paths = {row[0]: ExitPath(*row) for row in rows}
    else:  # the first row at fault, named
        paths = {}
        for row in rows:
            if not exit_rows_well_formed([row]):
                raise ValueError(f"has a malformed row: {row[0]!r}")
            if row[0] in paths:
                raise ValueError(f"lists {row[0]} twice")
            paths[row[0]] = ExitPath(*row)
    if releases is not None and list(paths) != list(releases):
        raise ValueError("must list the releases of releases/releases.tsv, in its order")
    for role in ROLES:
        files = [(version, row.files[role]) for version, row in paths.items()]
        if not role_rows_agree(files):
            raise ValueError(first_contradiction(role, files))
    return paths


def exit_rows_well_formed(rows: list[list[str]]) -> bool:
    """Whether every row has the table's fields, each digest 64 hex digits, each path a .py
    file within vllm/ with no . or .. step and no empty one, each diff named within its
    role's folder, and no version twice. By column, with C-level set and str operations
    (the gate reads every row on each run; a loop over the rows in Python costs it a
    tenth of a millisecond), and each distinct path and diff tested once."""
    if not rows or {len(row) for row in rows} != {len(EXIT_PATH_COLUMNS)}:
        return not rows
    versions, *cells = zip(*rows)
    width = len(ROLE_FIELDS)  # each role's columns: path, diff, sha256, fixed_sha256
    places = {place for column in cells[0::width] for place in column}
    diffs = {diff for column in cells[1::width] for diff in column}
    digests = [digest for start in (2, 3) for column in cells[start::width] for digest in column]
    return (sha256_digests(digests)
            and all(place.startswith("vllm/") and place.endswith(".py") and "/." not in place and "//" not in place
                    for place in places)
            and all(diff.endswith(".diff") and "/" not in diff and not diff.startswith(".") for diff in diffs)
            and len(set(versions)) == len(versions))


def role_rows_agree(files: "list[tuple[str, tuple[str, ...]]]") -> bool:
    """Whether a role's cells agree across the rows (version, (path, diff, sha256,
    fixed_sha256)): each diff writes one path, and each file is one diff's, on one side.
    By column, as the release table is checked: the gate reads every row on each run."""
    released, fixed = ({(cells[side], cells[1]) for _, cells in files} for side in (2, 3))
    released_digests, fixed_digests = {digest for digest, _ in released}, {digest for digest, _ in fixed}
    return (len({diff for _, (_, diff, _, _) in files}) == len({(path, diff) for _, (path, diff, _, _) in files})
            and len(released) == len(released_digests) and len(fixed) == len(fixed_digests)
            and released_digests.isdisjoint(fixed_digests))


def first_contradiction(role: str, files: "list[tuple[str, tuple[str, ...]]]") -> str:
    """What the first row at fault contradicts (role_rows_agree said one does)."""
    places: dict[str, str] = {}
    sides: dict[str, tuple[str, str]] = {}  # sha256 -> (side, diff)
    for version, (path, diff, release_sha256, fixed_sha256) in files:
        if places.setdefault(diff, path) != path:
            return f"gives patches/{role}/{diff} two paths"
        if (sides.setdefault(release_sha256, ("release", diff)) != ("release", diff)
                or sides.setdefault(fixed_sha256, ("fixed", diff)) != ("fixed", diff)):
            return f"gives a {role} file of {version} to two diffs or sides"
    return f"contradicts itself in its {role} rows"
