"""The patch bundle: where it is, its diffs read and parsed into Fixes, and their names."""
import os

from .outcome import BAD_BUNDLE, TARGET, Failure
from .seal import DAMAGED, HEADER, unsealed
from .table import HEX_DIGITS, table_problem

# Sequence is for annotations only: importing collections.abc costs the gate 2 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

# The bundle is the directory above this package (apply.py's), as it is, not a link to it.
HERE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
PATCHES_DIR = os.path.join(HERE, "patches")
# Each release's file and the file its diff makes of it, by sha256: a gate on a known
# file is a hash lookup.
TABLE = os.path.join(HERE, "releases", "releases.tsv")
LOOP_TEST = os.path.join(HERE, "test_rank_exception_fatal.py")
# The diffs of earlier bundles, and the files they made (scripts/supersede.py): read only
# for a file the release table does not know.
EARLIER_DIR = os.path.join(PATCHES_DIR, "superseded")
EARLIER_TABLE = os.path.join(HERE, "releases", "superseded.tsv")


class Hunk:
    """before: the hunk's context and removed lines, the release's text; after: its
    context and added lines, the fixed text. Lines keep their "\n". (A plain class: see
    outcome.Report.)"""

    __slots__ = ("before", "after")

    def __init__(self, before: tuple[str, ...], after: tuple[str, ...]) -> None:
        self.before, self.after = before, after

    def __repr__(self) -> str:
        return f"Hunk(before={self.before!r}, after={self.after!r})"


class Fix:
    """name: the diff's file name in patches/; hunks: its Hunks, in file order."""

    __slots__ = ("name", "hunks")

    def __init__(self, name: str, hunks: tuple[Hunk, ...]) -> None:
        self.name, self.hunks = name, hunks

    def __repr__(self) -> str:
        return f"Fix(name={self.name!r}, hunks=<{len(self.hunks)}>)"


def read_bundle(directory: "str | None" = None) -> list[Fix]:
    """Every diff of the bundle, parsed, once the release table agrees with them."""
    directory = directory or PATCHES_DIR
    try:
        names = diff_names(directory)
        texts = []
        for name in names:
            with open(os.path.join(directory, name), encoding="utf-8", newline="") as f:
                texts.append(f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the patch bundle in {directory}: {e}") from None
    if not names:
        raise Failure(BAD_BUNDLE, f"no .diff files in {directory}: the bundle is incomplete, copy it again")
    fixes = [parse_fix(name, text) for name, text in zip(names, texts)]
    check_table(names)
    return fixes


def diff_names(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".diff"))


def check_integrity(name: str, text: str) -> str:
    """The diff below the seal, if it is whole."""
    body, broken = unsealed(text)
    if broken == DAMAGED:
        raise Failure(BAD_BUNDLE, f"patches/{name} is cut short or damaged (its sha256 differs): copy the bundle again")
    if broken:
        raise Failure(BAD_BUNDLE, f"patches/{name} does not start with {HEADER.strip()!r}: write it with scripts/make_diff.py")
    return body


def parse_fix(name: str, text: str, target: str = TARGET) -> Fix:
    """The diff's hunks, once it is whole and changes target, and only target, with context."""
    body = check_integrity(name, text)
    try:
        from unidiff import PatchSet
    except ImportError:
        raise Failure(BAD_BUNDLE, "the unidiff package is missing: pip install unidiff") from None
    try:
        patch = PatchSet(body)
    except Exception as e:  # unidiff raises more than UnidiffParseError on odd input
        raise Failure(BAD_BUNDLE, f"patches/{name} is not a unified diff: {str(e).strip()}") from None
    if len(patch) != 1 or patch[0].path != target or not len(patch[0]):
        raise Failure(BAD_BUNDLE, f"patches/{name} must change {target} and nothing else")
    hunks = []
    for number, hunk in enumerate(patch[0], 1):
        # The context is what recognises a release; a hunk without it matches anywhere.
        if not any(line.is_context for line in hunk):
            raise Failure(
                BAD_BUNDLE, f"patches/{name} hunk {number} has no context lines: write it with scripts/make_diff.py"
            )
        hunks.append(Hunk(tuple(line.value for line in hunk.source_lines()),
                          tuple(line.value for line in hunk.target_lines())))
        if hunks[-1].before == hunks[-1].after:
            raise Failure(BAD_BUNDLE, f"patches/{name} hunk {number} changes nothing")
    return Fix(name, tuple(hunks))


def read_table_text(path: "str | None" = None) -> str:
    try:
        with open(path or TABLE, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the release table {path or TABLE}: {e}; copy the bundle again") from None


def check_table(diffs: "Sequence[str]") -> None:
    """Exit 5 unless the release table is whole and agrees with itself and the bundle."""
    problem = table_problem(read_table_text(), diffs)
    if problem:
        raise Failure(BAD_BUNDLE, f"releases/releases.tsv {problem}")


# --- diff names: vX.Y.Z.diff, for a release; main-COMMIT.diff, for a shape of upstream
# main between releases that no release has (releases/builds.tsv names its build).


def diff_release(name: str) -> "tuple[int, ...] | None":
    """v0.11.1.diff -> (0, 11, 1); None for any other name."""
    stem = name[:-len(".diff")] if name.endswith(".diff") else ""
    parts = stem[1:].split(".")
    return tuple(int(p) for p in parts) if stem.startswith("v") and all(p.isdigit() for p in parts) else None


def diff_commit(name: str) -> "str | None":
    """main-8fcaaf6a.diff -> "8fcaaf6a"; None for any other name."""
    commit = name[len("main-"):-len(".diff")] if name.startswith("main-") and name.endswith(".diff") else ""
    return commit if len(commit) == 8 and not commit.strip(HEX_DIGITS) else None


def written_for(name: str) -> str:
    """"vllm X.Y.Z", or "upstream main at COMMIT"."""
    commit = diff_commit(name)
    return f"upstream main at {commit}" if commit else f"vllm {name[1:-len('.diff')]}"
