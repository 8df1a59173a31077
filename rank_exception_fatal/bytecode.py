"""Bytecode that would run instead of the file: every cached .pyc of it, and which of
them hold other code than the file's."""
import os

from .outcome import TARGET

# The directory, within the tree, of the file the executor's diffs fix: its mirrors under
# a pycache prefix end so.
EXECUTOR_DIRECTORY = TARGET.rpartition("/")[0]

# Sequence is for annotations only: importing collections.abc costs the gate 2 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def bytecode_files(paths: "Sequence[str]", pycache_prefix: "str | None", tail: str = EXECUTOR_DIRECTORY) -> list[str]:
    """Every cached .pyc of these source paths, whatever Python wrote it: in __pycache__
    beside them and, with a pycache prefix (PYTHONPYCACHEPREFIX), in the mirror tree under it."""
    found = set()
    for path in paths:
        directories = [os.path.join(os.path.dirname(path), "__pycache__")]
        if pycache_prefix:
            directories += mirrors_in_prefix(pycache_prefix, os.path.dirname(path), tail)
        stem = os.path.splitext(os.path.basename(path))[0] + "."
        for directory in directories:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            found.update(os.path.join(directory, n) for n in names if n.startswith(stem) and n.endswith(".pyc"))
    return sorted(found)


def mirrors_in_prefix(prefix: str, directory: str, tail: str) -> list[str]:
    """The directories of a pycache prefix tree that mirror this one under any spelling
    of its path: Python mirrors the path it imported by (a venv reached through a
    symlink), which may not be the path apply.py was given."""
    real = os.path.realpath(directory)
    tail = os.path.join(*tail.split("/"))
    mirrors = []
    for mirror, subdirectories, _ in os.walk(prefix):
        source = os.sep + os.path.relpath(mirror, prefix)
        if not os.path.isdir(source):
            subdirectories.clear()  # a tree no longer there, or a mirror of a deleted one
        elif mirror.endswith(os.sep + tail) and os.path.realpath(source) == real:
            mirrors.append(mirror)
    return mirrors


def stale_bytecode(header: bytes, source: bytes) -> bool:
    """Whether a .pyc with this 16-byte header could run code other than source.

    Python checks a timestamp .pyc against the source's mtime and size, and compiles
    again when they differ. A hash-based .pyc it checks against the source's hash only
    if it is a checked one and the server runs without `--check-hash-based-pycs never`,
    which the gate cannot see: any hash-based .pyc of other code is stale. Its hash is
    keyed by the Python that wrote it and the function changed in 3.11, so one from
    another Python cannot be checked: stale."""
    if len(header) < 16 or not int.from_bytes(header[4:8], "little") & 0b01:  # timestamp-based
        return False
    import _imp
    from importlib.util import MAGIC_NUMBER

    return header[:4] != MAGIC_NUMBER or _imp.source_hash(int.from_bytes(MAGIC_NUMBER, "little"), source) != header[8:16]


def stale_bytecode_files(paths: "Sequence[str]", source: bytes, pycache_prefix: "str | None",
                         tail: str = EXECUTOR_DIRECTORY) -> list[str]:
    stale = []
    for pyc in bytecode_files(paths, pycache_prefix, tail):
        try:
            with open(pyc, "rb") as f:
                header = f.read(16)
        except OSError:
            continue
        if stale_bytecode(header, source):
            stale.append(pyc)
    return stale
