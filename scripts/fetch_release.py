"""Fetch vLLM release files from PyPI into a cache outside the repo.

    python3 scripts/fetch_release.py [VERSION ...]   # default: every release the bundle covers

Prints one directory per version, each holding vllm/v1/executor/multiproc_executor.py
exactly as in the vllm==VERSION wheel (checked against the wheel's RECORD). The
wheel (~300 MB) is downloaded to a temporary directory and dropped; only the one
file is kept, in $RANK_EXCEPTION_FATAL_CACHE (default ~/.cache/rank-exception-fatal).
"""
from __future__ import annotations

import base64
import csv
import glob
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence

TARGET = "vllm/v1/executor/multiproc_executor.py"
# Every release with the bug, oldest first; the test matrix and CI run all of them.
RELEASES = (
    "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0",
    "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "rank-exception-fatal")
    return os.environ.get("RANK_EXCEPTION_FATAL_CACHE") or default


def recorded_sha256(wheel: zipfile.ZipFile, name: str) -> str:
    [record] = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == name:
            algorithm, _, digest = row[1].partition("=")
            assert algorithm == "sha256", row
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise LookupError(f"{name} is not in the wheel's RECORD")


def download_release_file(version: str) -> bytes:
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--only-binary", ":all:", "--python-version", "3.12",
                "--platform", "manylinux_2_28_x86_64", "-d", download, f"vllm=={version}",
            ],
            check=True,
        )
        [wheel_path] = glob.glob(os.path.join(download, "vllm-*.whl"))
        with zipfile.ZipFile(wheel_path) as wheel:
            data = wheel.read(TARGET)
            if hashlib.sha256(data).hexdigest() != recorded_sha256(wheel, TARGET):
                raise ValueError(f"{TARGET} in {os.path.basename(wheel_path)} does not match its RECORD")
    return data


def release_tree(version: str) -> str:
    """The cached directory holding vllm/ for this release, fetched on first use."""
    tree = os.path.join(cache_dir(), "releases", version)
    path = os.path.join(tree, TARGET)
    if not os.path.isfile(path):
        data = download_release_file(version)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # A fetch killed half-way must not leave a half file that later runs trust.
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o644)
        os.replace(temp, path)
    return tree


def main(argv: Sequence[str] | None = None) -> int:
    versions = list(sys.argv[1:] if argv is None else argv) or list(RELEASES)
    for version in versions:
        try:
            print(release_tree(version), flush=True)
        except (subprocess.CalledProcessError, OSError, ValueError, LookupError) as e:
            print(f"fetch_release.py: cannot fetch vllm=={version}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
