"""The exit path's files as the package finds, decides and writes them (rank_exception_fatal/
exit_path.py, docs/supervisor.md §3), on every release's real launcher and server file.

Here: each release's files read as not applied with the diffs releases/exit_path.tsv names;
writing them gives what `git apply` of the helper's, launcher's and server's diffs gives,
and reverting gives the release's bytes back and removes the helper; a run killed after each
write leaves files that read as what was written, which the next run completes or reverts;
a file the table does not know, files of two releases, or a helper of other bytes drift, and
then nothing is written.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

import fetch_release
from fetch_release import RELEASES, exit_path_tree
from helpers import BUNDLE, read, write
from rank_exception_fatal import exit_path
from rank_exception_fatal.exit_path import HELPER, read_exit_path, write_exit_path
from rank_exception_fatal.outcome import APPLIED_STATE, DRIFTED_STATE, NOT_APPLIED_STATE

ROLE_PATHS = ("launcher", "server")


def release_files(version: str) -> dict[str, bytes]:
    """The release's launcher and server file, by their path in the tree."""
    row = fetch_release.exit_paths()[version]
    tree = exit_path_tree(version)
    paths = [fetch_release.diff_target(row.role(role)[0]) for role in ROLE_PATHS]
    return {path: read(os.path.join(tree, path)) for path in paths}


def make_exit_tree(root: str, files: dict[str, bytes]) -> str:
    for path, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        write(os.path.join(root, path), data)
    return root


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file under root/vllm, by its path in the tree (bytecode caches left out)."""
    found = {}
    for directory, subdirectories, names in os.walk(os.path.join(root, "vllm")):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        for name in names:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = read(path)
    return found


def git_apply(root: str, *diffs: str) -> None:
    done = subprocess.run(["git", "apply", "-p1", *(os.path.join(BUNDLE, "patches", d) for d in diffs)], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def states(root: str) -> list[tuple[str, str]]:
    return [(part.role, part.state) for part in read_exit_path(root)]


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_is_fixed_as_git_apply_fixes_it_and_reverted_byte_exact(version, tmp_path):
    files = release_files(version)
    root = make_exit_tree(str(tmp_path / "tree"), files)
    parts = read_exit_path(root)
    row = fetch_release.exit_paths()[version]
    assert [(p.role, p.state, p.diff) for p in parts] == [
        ("helper", NOT_APPLIED_STATE, "helper/helper.diff"),
        *((role, NOT_APPLIED_STATE, row.role(role)[0]) for role in ROLE_PATHS)]
    assert all(version in part.versions for part in parts[1:])

    reference = make_exit_tree(str(tmp_path / "git"), files)
    git_apply(reference, *(part.diff for part in parts))
    write_exit_path(root, revert=False)
    assert tree_bytes(root) == tree_bytes(reference)
    assert states(root) == [("helper", APPLIED_STATE), ("launcher", APPLIED_STATE), ("server", APPLIED_STATE)]

    write_exit_path(root, revert=True)
    assert tree_bytes(root) == files
    assert not os.path.exists(os.path.join(root, HELPER))


KILLED_AFTER = {  # (the write the run is killed after) -> the states it leaves
    1: [("helper", APPLIED_STATE), ("launcher", NOT_APPLIED_STATE), ("server", NOT_APPLIED_STATE)],
    2: [("helper", APPLIED_STATE), ("launcher", APPLIED_STATE), ("server", NOT_APPLIED_STATE)],
}

# A run of write_exit_path in a child that SIGKILLs itself once the Nth write is durable:
# what a power loss or a kill -9 at that point leaves on disk.
KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from rank_exception_fatal import disk, exit_path
synced, writes = disk.sync_directory, int(sys.argv[3])

def sync_then_maybe_die(directory):
    global writes
    synced(directory)
    writes -= 1
    if writes == 0:
        os.kill(os.getpid(), signal.SIGKILL)

disk.sync_directory = sync_then_maybe_die
exit_path.write_exit_path(sys.argv[2], revert=sys.argv[4] == "revert")
"""


def killed_run(root: str, writes: int, mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, BUNDLE, root, str(writes), mode], capture_output=True,
                          text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr


@pytest.mark.parametrize("version", ["0.8.5", "0.30.0", RELEASES[-1]])
@pytest.mark.parametrize("writes", [1, 2])
def test_a_run_killed_after_a_write_leaves_files_the_next_run_completes_or_reverts(version, writes, tmp_path):
    files = release_files(version)
    root = make_exit_tree(str(tmp_path / "tree"), files)
    killed_run(root, writes, "apply")
    assert states(root) == KILLED_AFTER[writes]
    assert not [name for path in files for name in os.listdir(os.path.dirname(os.path.join(root, path)))
                if name.startswith(".rank-exception-fatal-")]
    cut_short = shutil.copytree(root, str(tmp_path / "cut-short"))
    write_exit_path(root, revert=True)
    assert tree_bytes(root) == files
    write_exit_path(cut_short, revert=False)
    assert states(cut_short) == [("helper", APPLIED_STATE), ("launcher", APPLIED_STATE), ("server", APPLIED_STATE)]


@pytest.mark.parametrize("writes, left", [
    (1, [("helper", APPLIED_STATE), ("launcher", APPLIED_STATE), ("server", NOT_APPLIED_STATE)]),
    (2, [("helper", APPLIED_STATE), ("launcher", NOT_APPLIED_STATE), ("server", NOT_APPLIED_STATE)]),
])
def test_a_revert_killed_after_a_write_never_leaves_a_fixed_file_without_the_helper(writes, left, tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    write_exit_path(root, revert=False)
    killed_run(root, writes, "revert")
    assert states(root) == left
    write_exit_path(root, revert=True)
    assert tree_bytes(root) == files


def test_a_write_removes_the_bytecode_of_the_file_it_changes(tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    launcher = next(path for path in files if "launcher" in path.rpartition("/")[2])
    compiled = subprocess.run([sys.executable, "-m", "py_compile", os.path.join(root, launcher)], capture_output=True,
                              text=True)
    assert compiled.returncode == 0, compiled.stderr
    [pyc] = exit_path.bytecode_of(root, launcher, None)
    write_exit_path(root, revert=False)
    assert not os.path.exists(pyc)


def test_the_created_helper_takes_the_server_files_owner_and_mode(tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    server = next(part for part in read_exit_path(root) if part.role == "server")
    os.chmod(os.path.join(root, server.path), 0o640)
    write_exit_path(root, revert=False)
    assert oct(os.stat(os.path.join(root, HELPER)).st_mode & 0o777) == oct(0o640)


def assert_drifts_and_nothing_is_written(root: str, role: str, words: str) -> None:
    before = tree_bytes(root)
    drifted = [part for part in read_exit_path(root) if part.state == DRIFTED_STATE]
    assert role in [part.role for part in drifted] and words in drifted[0].why, drifted
    for revert in (False, True):
        parts = write_exit_path(root, revert=revert)
        assert [p.state for p in parts if p.role == role] == [DRIFTED_STATE]
        assert tree_bytes(root) == before


def test_a_launcher_no_release_has_drifts(tmp_path):
    files = release_files("0.30.0")
    launcher = next(path for path in files if "launcher" in path.rpartition("/")[2])
    files[launcher] += b"# a vendor's line\n"
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), files), "launcher",
                                         "is no release's launcher file this bundle knows")


def test_a_launcher_and_server_of_two_releases_drift(tmp_path):
    old, new = release_files("0.8.5"), release_files("0.30.0")
    launcher = next(path for path in old if "launcher" in path.rpartition("/")[2])
    server = next(path for path in new if "launcher" not in path.rpartition("/")[2])
    root = make_exit_tree(str(tmp_path), {launcher: old[launcher], server: new[server]})
    assert_drifts_and_nothing_is_written(root, "launcher", "files of two releases")


def test_a_tree_without_a_server_file_drifts(tmp_path):
    files = release_files("0.30.0")
    launcher = next(path for path in files if "launcher" in path.rpartition("/")[2])
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), {launcher: files[launcher]}), "server",
                                         "no server file at")


def test_a_helper_of_other_bytes_drifts(tmp_path):
    root = make_exit_tree(str(tmp_path), {**release_files("0.30.0"), HELPER: b"# someone else's module\n"})
    assert_drifts_and_nothing_is_written(root, "helper", "holds other bytes")
