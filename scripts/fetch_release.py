"""Fetch vLLM release files from PyPI into a cache outside the repo.

    python3 scripts/fetch_release.py [VERSION ...]   # default: every release in releases/releases.tsv
    python3 scripts/fetch_release.py --survey VERSION ...

Prints one directory per version, each holding vllm/v1/executor/multiproc_executor.py
and the API server's launcher and server file (the fix's files) exactly as in the
vllm==VERSION wheel, kept in $RANK_EXCEPTION_FATAL_CACHE (default
~/.cache/rank-exception-fatal)/releases/VERSION/. Every file is checked against the
sha256 that releases/releases.tsv (or releases/exit_path.tsv) records for its release.

The file is read out of the wheel that the table names with HTTP range requests:
the zip's central directory, its RECORD and the one member, a few hundred KB of a
250-500 MB wheel, checked against the wheel's RECORD too. Where the files host
does not honour ranges, the file comes from the sdist if the table says that the
sdist holds it byte-identical (its download checked against the index's sha256),
else from the whole wheel.

--survey makes a table row for releases not in the table yet: it reads the file
from the x86_64 wheel (each one, where a release has several), and downloads the
sdist once to say whether it holds the same bytes. It also reads the release's
ParallelConfig for enable_fault_tolerance. It prints a row less its diff and
fixed_sha256 columns: version, sha256, fault_tolerance, wheel, sdist.
"""
from __future__ import annotations

import base64
import csv
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections import namedtuple
from collections.abc import Sequence

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)  # the bundle's package: its vocabulary and its one reader of the release table

from rank_exception_fatal.bundle import TABLE  # noqa: E402
from rank_exception_fatal.outcome import TARGET  # noqa: E402
from rank_exception_fatal.table import ROLES, Release, read_exit_paths, read_releases  # noqa: E402

INDEX_URL = "https://pypi.org/simple/{project}/"
# Real builds between releases that PyPI carries (nightlies of upstream main, vendor
# builds): project, version, wheel, sha256 of TARGET, the diff that fits it, and what it is.
BUILDS = os.path.join(HERE, "releases", "builds.tsv")
TIMEOUT_SECONDS = 60


def read_table(path: str = TABLE) -> dict[str, Release]:
    """The release table (its seal not checked: a row may have been added, to be sealed
    with scripts/make_diff.py --table); ValueError if a row is malformed."""
    with open(path, encoding="utf-8", newline="") as f:
        try:
            return read_releases(f.read(), sealed=False)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


TABLE_ROWS = read_table()
# Every release with the bug, oldest first; the test matrix and CI run all of them.
RELEASES = tuple(TABLE_ROWS)


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "rank-exception-fatal")
    return os.environ.get("RANK_EXCEPTION_FATAL_CACHE") or default


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the index ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def index_files(project: str = "vllm") -> dict[str, dict]:
    """filename -> the index's entry (url, size, hashes), from PyPI's JSON simple API."""
    request = urllib.request.Request(
        INDEX_URL.format(project=project), headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
        return {entry["filename"]: entry for entry in json.load(response)["files"]}


def index_entry(filename: str, project: str = "vllm") -> dict:
    try:
        return index_files(project)[filename]
    except KeyError:
        raise LookupError(f"{filename} is not on the index") from None


def x86_64_wheels(version: str) -> list[str]:
    pattern = re.compile(rf"vllm-{re.escape(version)}-(?:\d[^-]*-)?[^-]+-[^-]+-[^-]*x86_64\.whl")
    return sorted(name for name in index_files() if pattern.fullmatch(name))


def build_number(wheel: str) -> int:
    """A wheel's build tag as a number, -1 without one."""
    parts = wheel[: -len(".whl")].split("-")
    return int(re.match(r"\d+", parts[2]).group()) if len(parts) == 6 else -1


def sdist_name(version: str) -> str | None:
    name = f"vllm-{version}.tar.gz"
    return name if name in index_files() else None


# --- reading a wheel by range ---------------------------------------------------


class RangeNotHonoured(Exception):
    """Not an OSError: zipfile would take that for "not a zip file"."""


class RemoteFile(io.RawIOBase):
    """A read-only, seekable view of a file on the files host, fetched block by block."""

    BLOCK = 1 << 18

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url, self.size, self.position = url, size, 0
        self.blocks: dict[int, bytes] = {}
        self.bytes_fetched = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def block(self, index: int) -> bytes:
        if index not in self.blocks:
            start = index * self.BLOCK
            end = min(start + self.BLOCK, self.size) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                if response.status != 206 or not response.headers.get("Content-Range", "").startswith(
                    f"bytes {start}-{end}/"
                ):
                    raise RangeNotHonoured(f"{self.url} did not answer a range request with that range")
                data = response.read()
            if len(data) != end - start + 1:
                raise OSError(f"{self.url}: short read at {start}")
            self.blocks[index] = data
            self.bytes_fetched += len(data)
        return self.blocks[index]

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.size - self.position))
        done = 0
        while done < count:
            index, offset = divmod(self.position + done, self.BLOCK)
            chunk = self.block(index)[offset : offset + count - done]
            buffer[done : done + len(chunk)] = chunk
            done += len(chunk)
        self.position += count
        return count


def recorded_sha256(wheel: zipfile.ZipFile, name: str) -> str:
    [record] = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == name:
            algorithm, _, digest = row[1].partition("=")
            assert algorithm == "sha256", row
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise LookupError(f"{name} is not in the wheel's RECORD")


def member_of_wheel(wheel_file, label: str, name: str = TARGET) -> bytes:
    with zipfile.ZipFile(wheel_file) as wheel:
        data = wheel.read(name)
        if sha256(data) != recorded_sha256(wheel, name):
            raise ValueError(f"{name} in {label} does not match the wheel's RECORD")
    return data


def download(url: str, expected_sha256: str, into) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as response:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            into.write(chunk)
    if digest.hexdigest() != expected_sha256:
        raise ValueError(f"{url} does not match the index's sha256")
    into.seek(0)


def read_from_wheel(filename: str, *, whole: bool = False, name: str = TARGET, project: str = "vllm") -> bytes:
    entry = index_entry(filename, project)
    if not whole:
        remote = io.BufferedReader(RemoteFile(entry["url"], entry["size"]), 1 << 16)
        return member_of_wheel(remote, filename, name)
    with tempfile.TemporaryFile() as f:
        download(entry["url"], entry["hashes"]["sha256"], f)
        return member_of_wheel(f, filename, name)


def read_from_sdist(filename: str) -> bytes:
    entry = index_entry(filename)
    with tempfile.TemporaryFile() as f:
        download(entry["url"], entry["hashes"]["sha256"], f)
        with tarfile.open(fileobj=f, mode="r:gz") as sdist:
            top = filename[: -len(".tar.gz")]
            member = sdist.extractfile(f"{top}/{TARGET}")
            if member is None:
                raise LookupError(f"{TARGET} is not a regular file in {filename}")
            return member.read()


def fetch(release: Release) -> bytes:
    try:
        data = read_from_wheel(release.wheel)
    except RangeNotHonoured:
        if release.sdist == "same":
            data = read_from_sdist(f"vllm-{release.version}.tar.gz")
        else:
            data = read_from_wheel(release.wheel, whole=True)
    if sha256(data) != release.sha256:
        raise ValueError(f"{TARGET} of vllm=={release.version} does not have the sha256 in releases/releases.tsv")
    return data


# --- the cache --------------------------------------------------------------------


def write_atomically(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # A fetch killed half-way must not leave a half file that later runs trust.
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), 0o644)
    os.replace(temp, path)


def release_tree(version: str) -> str:
    """The cached directory holding vllm/ for this release, with the fix's files (the
    executor, the launcher and the server file), each fetched on first use."""
    return exit_path_tree(version)


def executor_tree(version: str) -> str:
    """The cached directory holding vllm/ for this release, with its executor file, fetched on first use."""
    try:
        release = TABLE_ROWS[version]
    except KeyError:
        raise LookupError(f"vllm=={version} is not in releases/releases.tsv") from None
    tree = os.path.join(cache_dir(), "releases", version)
    path = os.path.join(tree, TARGET)
    try:
        with open(path, "rb") as f:
            cached_ok = sha256(f.read()) == release.sha256
    except FileNotFoundError:
        cached_ok = False
    if not cached_ok:
        write_atomically(path, fetch(release))
    return tree


EXIT_PATH_TABLE = os.path.join(HERE, "releases", "exit_path.tsv")
# Where each role's file of the exit path is, newest layout first (0.29.0 moved both).
EXIT_PATH_PLACES = {
    "launcher": ("vllm/entrypoints/launchers/launcher.py", "vllm/entrypoints/launcher.py"),
    "server": ("vllm/entrypoints/launchers/api_server/entry.py", "vllm/entrypoints/openai/api_server.py"),
    "queue": ("vllm/distributed/device_communicators/shm_broadcast.py",),
}


@functools.lru_cache(maxsize=None)
def exit_paths() -> dict:
    """releases/exit_path.tsv (scripts/make_exit_diffs.py writes it), checked whole."""
    with open(EXIT_PATH_TABLE, encoding="utf-8", newline="") as f:
        return read_exit_paths(f.read(), TABLE_ROWS)


def exit_path_tree(version: str) -> str:
    """executor_tree, also holding the release's launcher and server files (releases/exit_path.tsv),
    each checked against the sha256 that table records for it; fetched on first use, from
    one read of the wheel's directory."""
    tree = executor_tree(version)
    row = exit_paths()[version]
    wanted = {}
    for role in ROLES:
        path, digest = row.place(role), row.role(role)[1]
        try:
            with open(os.path.join(tree, path), "rb") as f:
                if sha256(f.read()) == digest:
                    continue
        except FileNotFoundError:
            pass
        wanted[path] = digest
    if wanted:
        release = TABLE_ROWS[version]
        try:
            found = read_members(release.wheel, list(wanted))
        except RangeNotHonoured:
            found = read_members(release.wheel, list(wanted), whole=True)
        for path, digest in wanted.items():
            if sha256(found[path]) != digest:
                raise ValueError(f"{path} of vllm=={version} does not have the sha256 in releases/exit_path.tsv")
            write_atomically(os.path.join(tree, path), found[path])
    return tree


def exit_path_files(version: str) -> list[tuple[str, str]]:
    """(its path in a tree, the cached copy) of the release's launcher and server file."""
    tree = exit_path_tree(version)
    paths = [exit_paths()[version].place(role) for role in ROLES]
    return [(path, os.path.join(tree, path)) for path in paths]


def read_members(filename: str, names: list[str], *, whole: bool = False, project: str = "vllm",
                 present: bool = False) -> dict[str, bytes]:
    """Several members of one wheel, each checked against its RECORD: the zip's directory read
    once. present: those of names that the wheel has (else each must be there)."""
    entry = index_entry(filename, project)
    with tempfile.TemporaryFile() as f:
        if whole:
            download(entry["url"], entry["hashes"]["sha256"], f)
            wheel_file = f
        else:
            wheel_file = io.BufferedReader(RemoteFile(entry["url"], entry["size"]), 1 << 16)
        with zipfile.ZipFile(wheel_file) as wheel:
            listed = set(wheel.namelist()) if present else set(names)
            found = {name: wheel.read(name) for name in names if name in listed}
            for name, data in found.items():
                if sha256(data) != recorded_sha256(wheel, name):
                    raise ValueError(f"{name} in {filename} does not match the wheel's RECORD")
    return found


# project, version, wheel: the wheel a build's file is read from; sha256: the build's file;
# diff: the diff that fixes it; fits: "exactly" (git apply takes the diff) or "adapted"
# (apply.py places the diff's own lines and proves the result); change: "-", or a file of
# tests/inputs/ that makes the build's file from the wheel's (an upstream commit that only
# GitHub holds, which CI cannot reach); what: where the build comes from (releases/builds.tsv).
Build = namedtuple("Build", "project version wheel sha256 diff fits change what")


def read_builds(path: str = BUILDS) -> list[Build]:
    with open(path, encoding="utf-8", newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("#")]
    header, *rows = list(csv.reader(lines, delimiter="\t"))
    if tuple(header) != Build._fields:
        raise ValueError(f"{path}: the header must be {' '.join(Build._fields)}, not {' '.join(header)}")
    builds = [Build(*row) for row in rows]
    for build in builds:
        if build.fits not in ("exactly", "adapted") or not (build.change == "-" or build.change.startswith("tests/inputs/")):
            raise ValueError(f"{path}: {build_name(build)}: fits is exactly or adapted, change is - or tests/inputs/FILE")
    return builds


def build_name(build: Build) -> str:
    """vllm-tpu-0.11.1, or vllm-tpu-0.11.1+vllm-d6953beb for that wheel's file with a change."""
    name = f"{build.project}-{build.version}"
    return name if build.change == "-" else f"{name}+{os.path.splitext(os.path.basename(build.change))[0]}"


def build_tree(build: Build) -> str:
    """The cached directory holding vllm/ for a build of builds.tsv, with the executor and
    the launcher and server file, fetched on first use."""
    tree = os.path.join(cache_dir(), "builds", build_name(build))
    path = os.path.join(tree, TARGET)
    try:
        with open(path, "rb") as f:
            if sha256(f.read()) == build.sha256 and has_exit_path(tree):
                return tree
    except FileNotFoundError:
        pass
    data = read_from_wheel(build.wheel, project=build.project)
    if build.change != "-":
        data = changed(data, os.path.join(HERE, build.change))
    if sha256(data) != build.sha256:
        raise ValueError(f"{TARGET} of {build_name(build)} does not have the sha256 in releases/builds.tsv")
    # (A change of tests/inputs/ is to the executor alone.)
    fetch_exit_path(tree, build.wheel, build.project)
    write_atomically(path, data)
    return tree


def has_exit_path(tree: str) -> bool:
    """Whether the tree holds a launcher and a server file, at any of their places."""
    return all(any(os.path.exists(os.path.join(tree, p)) for p in paths) for paths in EXIT_PATH_PLACES.values())


def fetch_exit_path(tree: str, wheel: str, project: str = "vllm") -> None:
    """The API server's launcher and server file into tree, as the wheel has them, each
    checked against the wheel's RECORD (for a build or release the exit path's table does
    not list): before the executor, whose bytes mark the tree complete."""
    places = [path for paths in EXIT_PATH_PLACES.values() for path in paths]
    try:
        found = read_members(wheel, places, project=project, present=True)
    except RangeNotHonoured:
        found = read_members(wheel, places, project=project, present=True, whole=True)
    for name, member in found.items():
        write_atomically(os.path.join(tree, name), member)


def changed(data: bytes, change: str) -> bytes:
    """The file that git apply makes of data with the change (a unified diff of TARGET)."""
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-build-") as work:
        path = os.path.join(work, TARGET)
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(data)
        subprocess.run(["git", "apply", change], cwd=work, check=True)
        with open(path, "rb") as f:
            return f.read()


def unlisted_release_tree(version: str, expected_sha256: str) -> str:
    """release_tree for a release the table does not list (one without the bug, or a new
    one), whose executor's sha256 the caller pins; with its launcher and server file."""
    tree = os.path.join(cache_dir(), "releases", version)
    path = os.path.join(tree, TARGET)
    try:
        with open(path, "rb") as f:
            if sha256(f.read()) == expected_sha256 and has_exit_path(tree):
                return tree
    except FileNotFoundError:
        pass
    wheels = x86_64_wheels(version)
    if not wheels:
        raise LookupError(f"vllm=={version} has no x86_64 wheel on the index")
    data = read_from_wheel(max(wheels, key=build_number))
    if sha256(data) != expected_sha256:
        raise ValueError(f"{TARGET} of vllm=={version} does not have the sha256 {expected_sha256}")
    fetch_exit_path(tree, max(wheels, key=build_number))
    write_atomically(path, data)
    return tree


# --- a new release ------------------------------------------------------------------


def has_fault_tolerance_setting(wheel: str) -> bool:
    """Whether the release's ParallelConfig declares enable_fault_tolerance."""
    for config in ("vllm/config/parallel.py", "vllm/config.py"):
        try:
            text = read_from_wheel(wheel, name=config).decode("utf-8")
        except KeyError:
            continue
        return re.search(r"^    enable_fault_tolerance\b", text, re.M) is not None
    raise LookupError(f"{wheel} has no vllm/config/parallel.py or vllm/config.py")


def survey(version: str) -> str:
    """The table row for a release, less its diff and fixed_sha256: one line, tab-separated."""
    wheels = x86_64_wheels(version)
    if not wheels:
        raise LookupError(f"vllm=={version} has no x86_64 wheel on the index")
    found = {name: read_from_wheel(name) for name in wheels}
    if len(set(found.values())) != 1:
        raise ValueError(f"the x86_64 wheels of vllm=={version} hold different files: {sorted(found)}")
    wheel = max(wheels, key=build_number)  # pip picks the highest build tag
    data = found[wheel]
    sdist = sdist_name(version)
    if sdist is None:
        same = "none"
    else:
        try:
            same = "same" if read_from_sdist(sdist) == data else "differs"
        except (LookupError, KeyError):
            same = "differs"
    write_atomically(os.path.join(cache_dir(), "releases", version, TARGET), data)
    fault_tolerance = "yes" if has_fault_tolerance_setting(wheel) else "no"
    return "\t".join((version, sha256(data), fault_tolerance, wheel, same))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--survey"]:
        for version in args[1:]:
            try:
                print(survey(version), flush=True)
            except (OSError, ValueError, LookupError, RangeNotHonoured, zipfile.BadZipFile, tarfile.TarError) as e:
                print(f"fetch_release.py: cannot survey vllm=={version}: {e}", file=sys.stderr)
                return 1
        return 0
    for version in args or RELEASES:
        try:
            print(release_tree(version), flush=True)
        except (OSError, ValueError, LookupError, zipfile.BadZipFile, tarfile.TarError) as e:
            print(f"fetch_release.py: cannot fetch vllm=={version}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
