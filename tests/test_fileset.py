"""apply.py on the fix as a set of four files (docs/supervisor.md §3, rank_exception_fatal/
fileset.py), on a release's real files: the gate says 0 only when every file is fixed; a run
killed after any write leaves files the gate reads as 1 (naming what remains), which the
next apply completes and --revert takes back byte for byte; --diff is what apply writes;
--json's files; nothing is written while any file drifted or cannot be written; an
executor fixed alone (--executor-only, or a bundle before the exit path) is upgraded by
writing the exit path only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

import apply
import fetch_release
from conftest import TARGET, release_bytes
from helpers import killed_after, needs_root, read, run_as_nobody, write
from rank_exception_fatal.exit_path import HELPER, WRITE_ORDER

VERSION = "0.30.0"
ROLES = ["executor", *WRITE_ORDER]


def fix_files(root: str) -> dict[str, bytes | None]:
    """Each file of the fix in the tree by its path there (None: absent)."""
    paths = [TARGET, HELPER, *(path for path, _ in fetch_release.exit_path_files(VERSION))]
    return {path: read(os.path.join(root, path)) if os.path.exists(os.path.join(root, path)) else None
            for path in paths}


def report_of(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()  # what runs before printed
    code = apply.main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def states(report: dict) -> dict[str, str]:
    return {entry["role"]: entry["state"] for entry in report["files"]}


def killed_run(writes: int, *args: str) -> None:
    """apply.py, killed after its Nth write."""
    killed_after(writes, "import apply\napply.main(sys.argv[1:])\n", *args)


# writes done -> the states they leave: apply writes WRITE_ORDER, then the executor; revert
# the executor first, then WRITE_ORDER backwards, the helper removed last.
APPLY_CUT = {writes: {"executor": "not-applied", **{role: "applied" if index < writes else "not-applied"
                                                    for index, role in enumerate(WRITE_ORDER)}}
             for writes in range(1, len(WRITE_ORDER) + 1)}
REVERT_CUT = {writes: {"executor": "not-applied", **{role: "not-applied" if index > len(WRITE_ORDER) - writes else "applied"
                                                     for index, role in enumerate(WRITE_ORDER)}}
              for writes in range(1, len(WRITE_ORDER) + 1)}


@pytest.mark.parametrize("mode, writes", [("apply", n) for n in APPLY_CUT] + [("revert", n) for n in REVERT_CUT])
def test_a_run_killed_after_any_write_reads_1_and_the_next_run_completes_or_reverts(mode, writes, make_tree,
                                                                                     tmp_path, capsys):
    root = make_tree(VERSION)
    release = fix_files(root)
    assert apply.main(["--root", root]) == 0
    fixed = fix_files(root)
    if mode == "apply":
        assert apply.main(["--root", root, "--revert"]) == 0
    capsys.readouterr()
    killed_run(writes, "--root", root, *(["--revert"] if mode == "revert" else []))
    code, report = report_of(capsys, "--root", root, "--check")
    assert (code, report["state"], states(report)) == (1, "not-applied", (APPLY_CUT if mode == "apply" else
                                                                          REVERT_CUT)[writes]), report
    remaining = [role for role, state in states(report).items() if role != "executor" and state != "applied"]
    assert all(role in report["message"] for role in remaining), report["message"]
    cut_short = shutil.copytree(root, str(tmp_path / "cut-short"), symlinks=True)
    assert apply.main(["--root", root]) == 0
    assert fix_files(root) == fixed
    assert apply.main(["--root", root, "--check"]) == 0
    assert apply.main(["--root", cut_short, "--revert"]) == 0
    assert fix_files(cut_short) == release


def test_the_diff_is_what_apply_writes_and_git_apply_takes_it(make_tree, capsys):
    root, reference = make_tree(VERSION), make_tree(VERSION)
    assert apply.main(["--root", root, "--diff"]) == 0
    patch = capsys.readouterr().out
    assert [line for line in patch.splitlines() if line.startswith("+++ ")] == [
        f"+++ b/{path}" for path in [HELPER, *(p for p, _ in fetch_release.exit_path_files(VERSION)), TARGET]]
    done = subprocess.run(["git", "apply", "-p1", "-"], input=patch, cwd=reference, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert apply.main(["--root", root]) == 0
    assert fix_files(root) == fix_files(reference)


def test_json_names_each_file_with_its_state(make_tree, capsys):
    root = make_tree(VERSION)
    code, report = report_of(capsys, "--root", root)
    assert code == 0 and report["action"] == "applied" and report["state"] == "applied"
    assert [entry["role"] for entry in report["files"]] == ROLES
    by_role = {entry["role"]: entry for entry in report["files"]}
    assert by_role["helper"]["sha256_before"] is None and by_role["helper"]["sha256_after"] is not None
    assert by_role["executor"]["diff"] == report["diff"] == "v0.30.0.diff"
    assert by_role["server"]["diff"] == fetch_release.exit_paths()[VERSION].role("server")[0]
    assert all(entry["path"].startswith(root + os.sep) and not entry["adapted"] for entry in report["files"])


def test_an_executor_fixed_alone_is_upgraded_by_writing_the_exit_path(make_tree, capsys):
    """As --executor-only, or a bundle before the exit path, leaves a node: it reads 1 now."""
    root = make_tree(VERSION)
    assert apply.main(["--root", root, "--executor-only"]) == 0
    executor = read(os.path.join(root, TARGET))
    assert apply.main(["--root", root, "--check", "--executor-only"]) == 0, "the one-file contract, kept"
    code, report = report_of(capsys, "--root", root, "--check")
    assert (code, states(report)["executor"]) == (1, "applied") and "the exit path's helper, launcher, server" \
        in report["message"], report
    code, report = report_of(capsys, "--root", root)
    assert (code, report["action"]) == (0, "applied") and "wrote helper, launcher, server" in report["message"]
    assert read(os.path.join(root, TARGET)) == executor
    assert apply.main(["--root", root, "--revert", "--executor-only"]) == 0
    assert read(os.path.join(root, TARGET)) == release_bytes(VERSION) and os.path.exists(os.path.join(root, HELPER))


def test_a_drifted_launcher_writes_nothing_and_names_executor_only(make_tree, capsys):
    root = make_tree(VERSION)
    launcher = os.path.join(root, fetch_release.exit_path_files(VERSION)[0][0])
    write(launcher, read(launcher).replace(b"shutdown_event.is_set()", b"shutdown_event.is_set() or False", 1))
    before = fix_files(root)
    for args in (["--check"], [], ["--diff"], ["--revert"]):
        code, report = report_of(capsys, "--root", root, *args)
        assert (code, report["state"]) == (2, "drifted"), (args, report)
        assert "launcher" in report["message"] and "--executor-only" in report["message"], report["message"]
        assert fix_files(root) == before, args
    assert apply.main(["--root", root, "--executor-only"]) == 0
    assert read(os.path.join(root, TARGET)) != release_bytes(VERSION)


def test_a_file_that_cannot_be_written_stops_the_run_before_any_write(public_tree, capfd):
    """The executor's directory is the user's, the exit path's are not: nothing is written,
    not even the files that could be."""
    needs_root()
    root, patches = public_tree
    os.chmod(os.path.dirname(os.path.join(root, TARGET)), 0o777)
    os.chown(os.path.join(root, TARGET), 65534, 65534)
    before = fix_files(root)
    assert run_as_nobody(["--root", root], patches) == 4
    err = capfd.readouterr().err
    assert "cannot write in" in err and "entrypoints" in err and len(err.strip().splitlines()) == 1, err
    assert fix_files(root) == before


def test_a_stale_pyc_of_a_fixed_exit_path_file_reads_1_and_apply_removes_it(make_tree, tmp_path, capsys):
    """An unchecked-hash .pyc of the release's server file would run in place of the fixed one."""
    import importlib.util
    import py_compile

    root = make_tree(VERSION)
    server = os.path.join(root, fetch_release.exit_path_files(VERSION)[1][0])
    release_copy = tmp_path / "entry.py"
    write(str(release_copy), read(server))
    assert apply.main(["--root", root]) == 0
    pyc = importlib.util.cache_from_source(server)
    py_compile.compile(str(release_copy), cfile=pyc, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    code, report = report_of(capsys, "--root", root, "--check")
    assert (code, report["state"]) == (1, "not-applied") and f"stale bytecode {pyc}" in report["message"], report
    assert apply.main(["--root", root]) == 0
    assert not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


def test_an_executor_whose_fix_cannot_be_planned_writes_no_file(make_tree, capsys):
    """A file the table does not know, whose fixed text would not compile: found before the
    exit path is written, not after."""
    root = make_tree(VERSION)
    write(os.path.join(root, TARGET), release_bytes(VERSION) + b"\ndef broken(:\n")
    before = fix_files(root)
    code, report = report_of(capsys, "--root", root)
    assert (code, report["state"]) == (2, "drifted"), report
    assert fix_files(root) == before


def test_an_executor_write_that_fails_after_the_exit_path_says_so(make_tree, monkeypatch, capsys):
    from rank_exception_fatal import change
    from rank_exception_fatal.outcome import CANNOT_READ_OR_WRITE, Failure

    def no_space(path: str, data: bytes, like=None) -> None:
        raise Failure(CANNOT_READ_OR_WRITE, f"cannot write {path}: No space left on device")

    root = make_tree(VERSION)
    monkeypatch.setattr(change, "replace_file", no_space)
    assert apply.main(["--root", root]) == 4
    err = capsys.readouterr().err
    assert "No space left" in err and f"the exit path was written first ({', '.join(WRITE_ORDER)})" in err, err
    monkeypatch.undo()
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0 and apply.main(["--root", root, "--check"]) == 0


def test_the_diff_s_json_gives_each_file_as_apply_will_write_it(make_tree, capsys):
    root = make_tree(VERSION)
    code, report = report_of(capsys, "--root", root, "--diff")
    assert (code, report["action"]) == (0, "would-apply")
    code, applied = report_of(capsys, "--root", root)
    assert code == 0
    assert [entry["sha256_after"] for entry in report["files"]] == [entry["sha256_after"] for entry in applied["files"]]


def test_a_bundle_copied_without_one_of_its_exit_path_diffs_is_refused(make_tree, tmp_path, monkeypatch, capsys):
    """The gate reads only the diff each file is decided by; a diff of another release missing
    from the copy still makes every mode exit 5, as a missing executor diff does."""
    from rank_exception_fatal import bundle

    root = make_tree(VERSION)
    assert apply.main(["--root", root]) == 0
    fixed = fix_files(root)
    patches = tmp_path / "patches"
    shutil.copytree(bundle.PATCHES_DIR, patches)
    unused = next(row.role("server")[0] for version, row in fetch_release.exit_paths().items()
                  if row.role("server")[0] != fetch_release.exit_paths()[VERSION].role("server")[0])
    os.unlink(patches / unused)
    monkeypatch.setattr(bundle, "PATCHES_DIR", str(patches))
    capsys.readouterr()
    for mode in (["--check"], [], ["--diff"], ["--revert"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert f"patches/{unused} is missing" in err and len(err.strip().splitlines()) == 1, err
    assert fix_files(root) == fixed


def test_a_revert_that_finds_an_exit_path_file_changed_takes_nothing_back(make_tree, monkeypatch, capsys):
    """Another program (pip) writes the server file after apply.py decided it: the revert
    stops before the executor, its first write, with exit 9."""
    from rank_exception_fatal import fileset

    root = make_tree(VERSION)
    assert apply.main(["--root", root]) == 0
    server = fetch_release.exit_path_files(VERSION)[1][0]
    line = b"# another program's line\n"
    checked = fileset.writable_or_refused

    def then_pip_writes(*args, **kwargs) -> None:
        checked(*args, **kwargs)
        write(os.path.join(root, server), read(os.path.join(root, server)) + line)

    monkeypatch.setattr(fileset, "writable_or_refused", then_pip_writes)
    before = fix_files(root)
    capsys.readouterr()
    assert apply.main(["--root", root, "--revert"]) == 9
    err = capsys.readouterr().err
    assert "changed while apply.py ran" in err and "nothing of the exit path was written" in err, err
    assert fix_files(root) == {**before, server: before[server] + line}, "the executor is not taken back either"


def compiled_of_this_python(source: str) -> str:
    from importlib.machinery import EXTENSION_SUFFIXES

    return source[: -len(".py")] + EXTENSION_SUFFIXES[0]


def compiled_of_another_python(source: str) -> str:
    """The server's Python may be another than the one apply.py runs under (--root)."""
    return source[: -len(".py")] + ".cpython-39-x86_64-linux-gnu.so"


def package_directory(source: str) -> str:
    return os.path.join(source[: -len(".py")], "__init__.py")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("shadow", [compiled_of_this_python, compiled_of_another_python, package_directory])
def test_a_module_python_imports_instead_of_a_fixed_file_is_not_a_source_file(role, shadow, make_tree, capsys):
    """Python's import system takes a compiled module or a package beside the fixed file, and
    that code has no hook: the set is decided as it would be imported, as the executor is."""
    root = make_tree(VERSION)
    assert apply.main(["--root", root]) == 0
    paths = dict(zip(ROLES, fix_files(root)))
    module = shadow(os.path.join(root, paths[role]))
    os.makedirs(os.path.dirname(module), exist_ok=True)
    write(module, b"\x7fELF")
    before = fix_files(root)
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 10, (mode, capsys.readouterr())
        err = capsys.readouterr().err
        assert f"Python imports vllm's {role} from {module}, not from a source file" in err, err
        assert len(err.splitlines()) == 1, err
    code, report = report_of(capsys, "--root", root, "--check")
    assert (code, report["exit_code"], report["state"]) == (10, 10, "error")
    assert fix_files(root) == before


@pytest.mark.parametrize("role", ["helper", "launcher"])
def test_a_stale_pyc_of_the_helper_or_launcher_reads_1_and_apply_removes_it(role, make_tree, tmp_path, capsys):
    """An unchecked-hash .pyc of other code than the fixed file would run in its place."""
    import importlib.util
    import py_compile

    root = make_tree(VERSION)
    assert apply.main(["--root", root]) == 0
    source = os.path.join(root, dict(zip(ROLES, fix_files(root)))[role])
    other = tmp_path / "other.py"
    write(str(other), b"" if role == "helper" else read(os.path.join(fetch_release.release_tree(VERSION),
                                                                         os.path.relpath(source, root))))
    pyc = importlib.util.cache_from_source(source)
    py_compile.compile(str(other), cfile=pyc, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    code, report = report_of(capsys, "--root", root, "--check")
    assert (code, report["state"]) == (1, "not-applied") and f"stale bytecode {pyc}" in report["message"], report
    assert apply.main(["--root", root]) == 0
    assert not os.path.exists(pyc)
    assert apply.main(["--root", root, "--check"]) == 0


def test_an_earlier_bundle_s_helper_reads_1_and_apply_replaces_it(make_tree, capsys):
    """A node fixed by an earlier bundle: its helper is replaced by today's (and revert removes it)."""
    from rank_exception_fatal import bundle
    from rank_exception_fatal.exit_path import EARLIER_HELPERS

    root = make_tree(VERSION)
    assert apply.main(["--root", root]) == 0
    for name in sorted(os.listdir(os.path.join(bundle.PATCHES_DIR, EARLIER_HELPERS))):
        os.unlink(os.path.join(root, HELPER))
        done = subprocess.run(["git", "apply", os.path.join(bundle.PATCHES_DIR, EARLIER_HELPERS, name)], cwd=root)
        assert done.returncode == 0
        earlier = read(os.path.join(root, HELPER))
        code, report = report_of(capsys, "--root", root, "--check")
        assert (code, states(report)["helper"]) == (1, "not-applied"), report
        assert "helper remains to apply" in report["message"]
        assert apply.main(["--root", root]) == 0
        assert read(os.path.join(root, HELPER)) != earlier
        assert apply.main(["--root", root, "--check"]) == 0
    os.unlink(os.path.join(root, HELPER))
    subprocess.run(["git", "apply", os.path.join(bundle.PATCHES_DIR, EARLIER_HELPERS, name)], cwd=root, check=True)
    assert apply.main(["--root", root, "--revert"]) == 0
    assert not os.path.exists(os.path.join(root, HELPER))
    assert fix_files(make_tree(VERSION)) == {path: data for path, data in fix_files(root).items()}
