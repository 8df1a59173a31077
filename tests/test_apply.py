"""apply.py's main job on trees made from the real release files: check, apply and revert, --diff
and --json, which file it works on, the command line, and a damaged bundle or release table."""
from __future__ import annotations

import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apply
from rank_exception_fatal import bundle, seal, table
from conftest import TARGET, release_bytes
from helpers import APPLY, BUNDLE, leftovers, patched_bytes, read, run_apply, target, write

pytestmark = pytest.mark.usefixtures("no_environment_root")  # the tree each test names, not scripts/test's


SHAPES = ("0.26.0", "0.30.0", "0.33.0")


def with_header(body: str) -> str:
    """A diff as scripts/make_diff.py writes it: the digest of the rest on its first line."""
    return f"{seal.HEADER}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def copy_bundle(tmp_path, monkeypatch) -> str:
    """A copy of patches/ that apply.py reads instead, for a test to damage."""
    patches = tmp_path / "patches"
    shutil.copytree(bundle.PATCHES_DIR, patches)
    monkeypatch.setattr(bundle, "PATCHES_DIR", str(patches))
    return str(patches)


@pytest.mark.parametrize("version", SHAPES)
def test_check_apply_revert_cycle(version, make_tree, tmp_path, capsys):
    root = make_tree(version)
    path = target(root)
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0
    assert read(path) == patched_bytes(version, tmp_path)
    assert f"patches/v{version}.diff" in capsys.readouterr().out
    assert apply.main(["--root", root, "--check"]) == 0

    before = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    assert apply.main(["--root", root]) == 0
    assert "already applied" in capsys.readouterr().out
    assert os.stat(path).st_mtime_ns == before, "an applied file is not written again"

    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(path) == release_bytes(version)
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(path) == release_bytes(version)
    assert apply.main(["--root", root, "--check"]) == 1
    assert leftovers(root) == []


def test_check_decides_a_known_file_by_its_hash(make_tree, monkeypatch, capsys):
    """The gate reads no diff for a file the release table knows: without unidiff it still answers."""
    root = make_tree("0.30.0")
    assert apply.main(["--root", root]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "unidiff", None)  # an import of it now fails
    for state, code in (("applied", 0), ("not-applied", 1)):
        assert apply.main(["--root", root, "--check", "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["state"], report["diff"]) == (state, "v0.30.0.diff")
        write(target(root), release_bytes("0.30.0"))
    # Any other file is decided by the diffs, which need unidiff.
    write(target(root), release_bytes("0.30.0") + b"# a line the table does not know\n")
    assert apply.main(["--root", root, "--check"]) == 5
    assert "unidiff package is missing" in capsys.readouterr().err


def test_root_comes_from_the_environment(make_tree, monkeypatch):
    root = make_tree("0.30.0")
    monkeypatch.setenv("GAUDI_FIXES_ROOT", root)
    assert apply.main(["--check"]) == 1
    assert apply.main([]) == 0
    assert apply.main(["--check"]) == 0


def test_diff_prints_the_change_and_writes_nothing(make_tree, tmp_path, capsys):
    root = make_tree("0.30.0")
    assert apply.main(["--root", root, "--diff"]) == 0
    change = capsys.readouterr().out
    assert apply.main(["--root", root, "--dry-run"]) == 0
    assert capsys.readouterr().out == change
    assert read(target(root)) == release_bytes("0.30.0")
    # The printed change is a real diff: applying it gives what apply.py would write.
    (tmp_path / "printed.diff").write_text(change)
    subprocess.run(["patch", "-p1", "-F0", "-s", "-i", str(tmp_path / "printed.diff")], cwd=root, check=True)
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)


def test_json_report(make_tree, capsys):
    root = make_tree("0.26.0")
    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "applied" and report["action"] == "applied"
    assert report["path"] == target(root) and report["diff"] == "v0.26.0.diff"
    assert report["sha256_before"] != report["sha256_after"]
    assert report["exit_code"] == 0 and report["version"] is None and report["distribution"] is None
    assert apply.main(["--root", root, "--check", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["action"] == "none" and again["sha256_before"] == report["sha256_after"]


def test_a_file_with_a_byte_order_mark(make_tree, tmp_path):
    """Python reads the mark and the rest alike; the functions are the release's."""
    root = make_tree("0.30.0")
    bom = b"\xef\xbb\xbf"
    write(target(root), bom + release_bytes("0.30.0"))
    assert apply.main(["--root", root, "--check"]) == 1
    assert apply.main(["--root", root]) == 0
    assert read(target(root)) == bom + patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--root", root, "--check"]) == 0
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(target(root)) == bom + release_bytes("0.30.0")


def test_without_a_target(tmp_path, monkeypatch, capsys):
    assert apply.main(["--root", str(tmp_path)]) == 3
    assert "must be the directory holding vllm/" in capsys.readouterr().err
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert apply.main(["--check"]) == 3
    assert "no vllm package" in capsys.readouterr().err


def test_a_namespace_portion_without_the_executor(tmp_path, make_tree, monkeypatch, capsys):
    """vllm/ as a namespace package whose first portion has no v1/: Python imports the second's."""
    first = tmp_path / "first"
    (first / "vllm" / "plugins").mkdir(parents=True)
    second = make_tree("0.30.0")
    monkeypatch.setattr(sys, "path", [str(first), second])
    assert apply.main(["--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["path"] == target(second)


def compiled_beside_the_source(root: str) -> str:
    """A compiled module where a Cython build leaves it: Python imports it before the .py."""
    from importlib.machinery import EXTENSION_SUFFIXES

    module = target(root)[: -len(".py")] + EXTENSION_SUFFIXES[0]
    write(module, b"\x7fELF")
    return module


def bytecode_only(root: str) -> str:
    """Only a .pyc where the source was (compileall -b, then the .py removed)."""
    pyc = target(root) + "c"
    py_compile.compile(target(root), cfile=pyc)
    os.unlink(target(root))
    return pyc


@pytest.mark.parametrize("form", [compiled_beside_the_source, bytecode_only])
def test_an_executor_python_imports_from_no_source(form, make_tree, capsys):
    """Exit 3 means "no executor here"; fleet tooling reads it as not affected. These have one."""
    root = make_tree("0.30.0")
    module = form(root)
    for args in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *args]) == 10, args
        err = capsys.readouterr().err
        assert f"Python imports vllm's executor from {module}, not from a source file" in err
        assert len(err.splitlines()) == 1


def test_an_executor_in_a_zip(make_tree, tmp_path):
    root = make_tree("0.30.0")
    archive = str(tmp_path / "vllm.zip")
    shutil.make_archive(archive[: -len(".zip")], "zip", root)
    done = run_apply("--check", "--json", env={**os.environ, "PYTHONPATH": archive})
    assert done.returncode == 10, done.stderr
    assert json.loads(done.stdout)["message"].startswith(f"Python imports vllm's executor from {archive}/{TARGET}")


def cut_before_second_hunk(text: str) -> str:
    return text[: text.index("\n@@", text.index("\n@@") + 1) + 1]


NO_CONTEXT = f"--- a/{TARGET}\n+++ b/{TARGET}\n@@ -0,0 +1,1 @@\n+import os\n"
# name: (release, diff file, what becomes of its text, what the message says)
BAD_BUNDLES = {
    # An interrupted copy: what is left still parses as a whole diff of one hunk.
    "cut-at-a-hunk-boundary": ("0.33.0", "v0.33.0.diff", cut_before_second_hunk, "v0.33.0.diff is cut short or damaged"),
    "cut-in-a-hunk": ("0.33.0", "v0.33.0.diff", lambda t: t[:3000], "v0.33.0.diff is cut short or damaged"),
    "one-line-changed": ("0.33.0", "v0.33.0.diff", lambda t: t.replace("+", "+#", 1), "v0.33.0.diff is cut short or damaged"),
    "no-header": ("0.30.0", "v0.30.0.diff", lambda t: t.partition("\n")[2], "v0.30.0.diff does not start with"),
    "empty": ("0.30.0", "empty.diff", lambda t: "", "empty.diff does not start with"),
    "garbage": ("0.30.0", "garbage.diff", lambda t: with_header("@@ this is not a diff\n+\n"), "must change"),
    "other-file": ("0.30.0", "other-file.diff",
                   lambda t: with_header("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n"), "must change"),
    "no-context": ("0.30.0", "no-context.diff", lambda t: with_header(NO_CONTEXT), "no-context.diff hunk 1 has no context lines"),
    # Two diffs for one release: which one is meant is the bundle's to say.
    "two-diffs-fit": ("0.30.0", "v0.30.0-copy.diff", lambda t: (Path(bundle.PATCHES_DIR) / "v0.30.0.diff").read_text(),
                      "patches/v0.30.0-copy.diff and patches/v0.30.0.diff both fit"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_malformed_bundle(case, make_tree, tmp_path, monkeypatch, capsys):
    version, name, mangle, complaint = BAD_BUNDLES[case]
    root = make_tree(version)
    original = Path(bundle.PATCHES_DIR) / name
    text = mangle(original.read_text() if original.exists() else "")
    (Path(copy_bundle(tmp_path, monkeypatch)) / name).write_text(text)
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert complaint in err and len(err.strip().splitlines()) == 1, err
        assert read(target(root)) == release_bytes(version)


def test_a_diff_that_gives_a_file_that_does_not_compile(make_tree, tmp_path, monkeypatch, capsys):
    root = make_tree("0.30.0")
    diff = Path(copy_bundle(tmp_path, monkeypatch)) / "v0.30.0.diff"
    body = diff.read_text().partition("\n")[2]
    # An added line that is not Python; the hunk's line counts stay right.
    added = next(line for line in body.splitlines(keepends=True) if line.startswith("+") and not line.startswith("+++"))
    diff.write_text(with_header(body.replace(added, "+            this is not python\n", 1)))
    assert apply.main(["--root", root]) == 5
    assert "patches/v0.30.0.diff gives a file that does not compile" in capsys.readouterr().err
    assert read(target(root)) == release_bytes("0.30.0")
    assert leftovers(root) == []


def test_missing_bundle(make_tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bundle, "PATCHES_DIR", str(tmp_path / "nowhere"))
    assert apply.main(["--root", make_tree("0.30.0"), "--check"]) == 5
    assert "cannot read the patch bundle" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--check", "--revert"], ["--diff", "--verify"], ["--bogus"], ["--root"], ["--root="], ["--root", "--check"], ["x"]]
)
def test_usage_errors_have_their_own_code(args, capsys):
    assert apply.main(args) == 6
    err = capsys.readouterr().err
    assert err.startswith("apply.py: usage error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--json", "--bogus"], ["--check", "--json", "--revert"], ["--json", "--root"]])
def test_usage_errors_under_json_print_one_object(args, capsys):
    assert apply.main(args) == 6
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 6 and report["state"] == "error" and report["message"].startswith("usage error:")


def test_root_takes_both_spellings(make_tree, capsys):
    root = make_tree("0.30.0")
    assert apply.main([f"--root={root}", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "would-apply"
    assert apply.main(["--check", "--root", root, "--check"]) == 1


def test_help_lists_every_exit_code(capsys):
    assert apply.main(["--help"]) == 0
    out = capsys.readouterr().out
    for code in range(13):
        assert f"\n {code:>2}  " in out


def test_script_runs_outside_its_directory(make_tree, tmp_path):
    root = make_tree("0.30.0")
    done = subprocess.run([sys.executable, APPLY, "--root", root, "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "v0.30.0.diff" in done.stdout


def test_script_run_through_a_symlink_finds_its_bundle(make_tree, tmp_path):
    """A link on PATH to apply.py: the bundle is beside the file, not beside the link."""
    link = tmp_path / "bin" / "rank-exception-fatal"
    link.parent.mkdir()
    link.symlink_to(APPLY)
    done = subprocess.run([sys.executable, str(link), "--root", make_tree("0.30.0")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("applied patches/v0.30.0.diff")


def test_the_gate_ends_at_once_with_its_whole_report(make_tree, tmp_path):
    """--check ends without the interpreter's teardown (cli.leave): an atexit callback of the
    operator's Python does not run, yet every byte the gate printed reaches a file or a pipe
    and its status is the report's. Another mode, and the gate run by a profiler (which
    writes its data once the script returns), exit as Python does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os\natexit.register(lambda: open(os.environ['EXIT_MARK'], 'a').write('exit\\n'))\n")
    mark = tmp_path / "mark"
    env = {**os.environ, "EXIT_MARK": str(mark),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    release, fixed = make_tree("0.30.0"), make_tree("0.30.0")
    assert subprocess.run([sys.executable, APPLY, "--root", fixed], capture_output=True, env=env).returncode == 0
    assert mark.read_text() == "exit\n", "an apply exits as Python does"
    mark.unlink()
    for root, expected in ((release, 1), (fixed, 0)):
        with open(tmp_path / "report.json", "w") as out:
            to_file = subprocess.run([sys.executable, APPLY, "--root", root, "--check", "--json"], stdout=out, env=env)
        to_pipe = subprocess.run([sys.executable, APPLY, "--root", root, "--check", "--json"], capture_output=True,
                                 text=True, env=env)
        for code, text in ((to_file.returncode, (tmp_path / "report.json").read_text()), (to_pipe.returncode, to_pipe.stdout)):
            assert code == expected and json.loads(text)["exit_code"] == expected and text.endswith("}\n"), text
        assert not mark.exists(), "the gate ended at once"
    profiled = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "gate.prof"), APPLY, "--root",
                               fixed, "--check"], capture_output=True, env=env)
    assert profiled.returncode == 0 and (tmp_path / "gate.prof").stat().st_size > 0 and mark.read_text() == "exit\n"


def test_stdout_that_cannot_take_the_report(make_tree, tmp_path):
    root = make_tree("0.30.0")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, APPLY, "--root", root], stdout=full, stderr=subprocess.PIPE, text=True)
        check = subprocess.run([sys.executable, APPLY, "--root", root, "--check"], stdout=full,
                               stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, "the file was written, and the code says so"
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)
    assert done.stderr.startswith("apply.py: cannot print the report:") and len(done.stderr.splitlines()) == 1
    assert check.returncode == 0 and len(check.stderr.splitlines()) == 1
    closed = subprocess.run(["sh", "-c", '"$@" >&-', "sh", sys.executable, APPLY, "--root", root, "--check"],
                            capture_output=True, text=True)
    assert (closed.returncode, closed.stderr) == (0, "apply.py: cannot print the report: stdout is closed\n")
    neither = subprocess.run(["sh", "-c", '"$@" >&- 2>&-', "sh", sys.executable, APPLY, "--root", str(tmp_path)])
    assert neither.returncode == 3


def test_a_path_the_output_encoding_cannot_spell(make_tree):
    root = make_tree("0.30.0", name="caf\u00e9")
    done = run_apply("--root", root, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("applied patches/v0.30.0.diff") and "caf\\xe9" in done.stdout


def test_apply_py_needs_its_package_beside_it(make_tree, tmp_path):
    """apply.py copied without rank_exception_fatal/: one line, exit 5, also where another
    bundle's package is on the path (it is not the one that belongs to this apply.py)."""
    copy = tmp_path / "bundle"
    copy.mkdir()
    shutil.copy(APPLY, copy)
    shutil.copytree(bundle.PATCHES_DIR, copy / "patches")
    env = {**os.environ, "PYTHONPATH": BUNDLE}
    for args in (["--check"], ["--verify"], ["--check", "--json"]):
        done = subprocess.run([sys.executable, str(copy / "apply.py"), *args, "--root", make_tree("0.30.0")],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 5, args
        out = done.stdout if "--json" in args else done.stderr
        assert "rank_exception_fatal is missing: copy the whole bundle" in out and len(out.splitlines()) == 1, out
        if "--json" in args:
            assert json.loads(out)["exit_code"] == 5



def bundle_copy(tmp_path, edit) -> str:
    """apply.py of a copy of the whole bundle, once edit(package directory) changed its package."""
    import rank_exception_fatal

    copy = tmp_path / "bundle"
    shutil.copytree(BUNDLE, copy, ignore=lambda directory, names: [n for n in names if n in (
        ".git", "tests", "scripts", "docs", "fleet", "__pycache__", ".pytest_cache")])
    edit(copy / "rank_exception_fatal")
    assert os.path.dirname(rank_exception_fatal.__file__) != str(copy / "rank_exception_fatal")
    return str(copy / "apply.py")


def bundle_fault_outputs(script: str, root: str, modes) -> list[tuple[list[str], str]]:
    """Each mode's output (its one JSON object with --json, else its stderr line), once the
    bundle's apply.py ran it and exited 5 in one line, as a bundle fault must."""
    outputs = []
    for args in modes:
        done = subprocess.run([sys.executable, script, "--root", root, *args], capture_output=True, text=True,
                              timeout=120)
        out = done.stdout if "--json" in args else done.stderr
        assert done.returncode == 5 and len(out.splitlines()) == 1, (args, done)
        outputs.append((args, out))
    return outputs


def every_module() -> list[str]:
    """The package's modules as they are on disk (but __init__), as paths without .py."""
    package = os.path.join(BUNDLE, "rank_exception_fatal")
    found = (os.path.relpath(os.path.join(d, n), package) for d, _, names in os.walk(package) for n in names)
    return sorted(path[: -len(".py")] for path in found if path.endswith(".py") and path != "__init__.py")


def test_the_package_lists_every_file_with_its_size():
    """FILES, which apply.py checks at start, is the package as it is (after an edit, the
    message gives the dict to paste into rank_exception_fatal/__init__.py)."""
    import rank_exception_fatal

    package = os.path.dirname(rank_exception_fatal.__file__)
    files = {f"{m}.py": os.path.getsize(os.path.join(package, f"{m}.py")) for m in every_module()}
    files["../test_rank_exception_fatal.py"] = os.path.getsize(os.path.join(BUNDLE, "test_rank_exception_fatal.py"))
    assert rank_exception_fatal.FILES == files, f"FILES = {dict(sorted(files.items()))!r}"
    assert rank_exception_fatal.damaged_file() is None


@pytest.mark.parametrize("module", every_module())
def test_a_bundle_copied_without_any_module_says_5_in_one_line(module, make_tree, tmp_path):
    """A bundle synced in part: exit 5 (never 1, which a deploy step reads as "run apply"),
    one line, or one JSON object, in every mode, before anything is read or written."""
    root = make_tree("0.30.0")
    script = bundle_copy(tmp_path, lambda package: os.unlink(package / f"{module}.py"))
    modes = [["--check", "--json"], ["--check"]] + ([[], ["--revert"], ["--diff"], ["--verify"]]
                                                    if module in ("exit_path", "hooks", "loop_probe/child") else [])
    for args, out in bundle_fault_outputs(script, root, modes):
        assert f"rank_exception_fatal/{module}.py is missing" in out, out
        if "--json" in args:
            assert json.loads(out)["exit_code"] == 5
    assert read(target(root)) == release_bytes("0.30.0")


@pytest.mark.parametrize("name", ["cli.py", "fileset.py", "check.py", "loop_probe/cases.py",
                                  "../test_rank_exception_fatal.py"])
def test_a_file_cut_at_a_line_end_says_5_in_one_line(name, make_tree, tmp_path):
    """A copy cut short at a line's end still compiles, and could end a run with a wrong
    answer (cli.py's main cut before its return answered None, read as 0)."""
    root = make_tree("0.30.0")

    def cut(package):
        path = package / name
        lines = path.read_text().splitlines(True)
        path.write_text("".join(lines[: len(lines) // 2]))

    script = bundle_copy(tmp_path, cut)
    for args, out in bundle_fault_outputs(script, root, (["--check", "--json"], ["--check"], [])):
        assert f"{os.path.normpath(os.path.join('rank_exception_fatal', name))} is cut short or changed" in out, out
    assert read(target(root)) == release_bytes("0.30.0")


@pytest.mark.parametrize("module", ["exit_path", "hooks"])
def test_a_damaged_module_imported_during_the_run_says_5_in_one_line(module, make_tree, tmp_path):
    """A module damaged in place (its size kept) fails only where a mode imports it: 5, one line."""
    root = make_tree("0.30.0")
    # A release the table does not know: the launcher has a line changed, so its diff is placed by its own
    # lines, which imports hooks.
    import fetch_release

    launcher = os.path.join(root, fetch_release.exit_path_files("0.30.0")[0][0])
    write(launcher, read(launcher).replace(b"\n", b"\n\n", 1))
    def damage(package):  # a byte changed in place, the size kept: past the start's check, not past the import
        path = package / f"{module}.py"
        path.write_text("def cut(\n" + " " * (path.stat().st_size - len("def cut(\n")))

    script = bundle_copy(tmp_path, damage)
    for args, out in bundle_fault_outputs(script, root, (["--check", "--json"], ["--check"], [])):
        assert "cannot be loaded (SyntaxError" in out, out
        if "--json" in args:
            assert json.loads(out)["exit_code"] == 5
    assert read(target(root)) == release_bytes("0.30.0")

# Each row problem, in a table sealed again after the edit (as an editor would), and an
# edit without the seal: the bundle is malformed, and no file is decided by that table.
def table_rows_edited(edit):
    def mangle(text: str) -> str:
        import make_diff

        first, _, body = text.partition("\n")
        lines = body.splitlines(True)
        row = next(i for i, line in enumerate(lines) if line.startswith("0.30.0\t"))
        body = "".join(edit(lines, row))
        return f"{make_diff.TABLE_HEADER}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"
    return mangle


def sha256_as(value):
    """The 0.30.0 row with its release sha256 made into value(sha256)."""
    def edit(lines, row):
        cells = lines[row].split("\t")
        cells[2] = value(cells[2])
        return lines[:row] + ["\t".join(cells)] + lines[row + 1:]
    return edit


def fixed_as_released(lines, row):
    cells = lines[row].split("\t")
    cells[3] = cells[2]
    return lines[:row] + ["\t".join(cells)] + lines[row + 1:]


BAD_TABLES = {
    "fixed-equals-release": (table_rows_edited(fixed_as_released), "gives 0.30.0 a fixed_sha256 equal to its sha256"),
    "version-twice": (table_rows_edited(lambda lines, row: lines[:row + 1] + lines[row:]), "lists 0.30.0 twice"),
    "diff-missing": (table_rows_edited(lambda lines, row: lines[:row] + [lines[row].replace("v0.30.0.diff", "v0.30.9.diff")]
                                       + lines[row + 1:]), "names v0.30.9.diff for 0.30.0, which is not in patches/"),
    "edited-without-the-seal": (lambda text: text.replace("\nversion\t", "\n# a note\nversion\t"),
                                "is cut short or damaged (its sha256 differs)"),
    "no-seal": (lambda text: text.partition("\n")[2], "does not start with '# sha256 of the lines below:'"),
    # Each a malformed row, whatever the other rows' digests make up together.
    "sha256-short": (table_rows_edited(sha256_as(lambda d: d[1:])), "has a malformed row: '0.30.0'"),
    "sha256-upper-case": (table_rows_edited(sha256_as(str.upper)), "has a malformed row: '0.30.0'"),
    "sha256-with-a-space": (table_rows_edited(sha256_as(lambda d: d[:10] + " " + d[11:])),
                            "has a malformed row: '0.30.0'"),
    "sha256-not-hex": (table_rows_edited(sha256_as(lambda d: "g" + d[1:])), "has a malformed row: '0.30.0'"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_damaged_release_table_is_a_malformed_bundle(case, make_tree, tmp_path, monkeypatch, capsys):
    mangle, complaint = BAD_TABLES[case]
    table_file = tmp_path / "releases.tsv"
    table_file.write_text(mangle(Path(bundle.TABLE).read_text()))
    monkeypatch.setattr(bundle, "TABLE", str(table_file))
    root = make_tree("0.30.0")
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert f"releases/releases.tsv {complaint}" in err and len(err.strip().splitlines()) == 1, err
        assert read(target(root)) == release_bytes("0.30.0")


def test_the_release_table_is_sealed(tmp_path, monkeypatch, make_tree):
    """The table in the bundle is whole, and scripts/make_diff.py --table seals an edited one."""
    import make_diff

    text = Path(bundle.TABLE).read_text()
    assert table.table_problem(text, sorted(os.listdir(bundle.PATCHES_DIR))) is None
    table_file = tmp_path / "releases.tsv"
    table_file.write_text(text.partition("\n")[2].replace("\nversion\t", "\n# a note\nversion\t"))
    make_diff.seal_table(str(table_file))
    assert table.table_problem(table_file.read_text()) is None
    monkeypatch.setattr(bundle, "TABLE", str(table_file))
    assert apply.main(["--root", make_tree("0.30.0"), "--check"]) == 1
