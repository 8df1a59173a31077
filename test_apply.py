"""apply.py on trees made from the real release files: states, exit codes, safe writes."""
from __future__ import annotations

import hashlib
import json
import os
import py_compile
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import apply
from conftest import TARGET, release_bytes

APPLY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "apply.py")
SHAPES = ("0.26.0", "0.30.0", "0.33.0")


def target(root: str) -> str:
    return os.path.join(root, TARGET)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def patched_bytes(version: str, tmp_path) -> bytes:
    """The release file after `git apply` of its diff: what apply.py must write too."""
    root = tmp_path / f"git-{version}"
    (root / TARGET).parent.mkdir(parents=True)
    write(str(root / TARGET), release_bytes(version))
    subprocess.run(["git", "apply", os.path.join(apply.PATCHES_DIR, f"v{version}.diff")], cwd=root, check=True)
    return read(str(root / TARGET))


def leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.dirname(target(root))) if n != "multiproc_executor.py")


@pytest.fixture(autouse=True)
def no_environment_root(monkeypatch):
    monkeypatch.delenv("GAUDI_FIXES_ROOT", raising=False)


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
    assert read(target(root)) == release_bytes("0.30.0")
    # The printed change is a real diff: applying it gives what apply.py would write.
    (tmp_path / "printed.diff").write_text(change)
    subprocess.run(["patch", "-p1", "-F0", "-s", "-i", str(tmp_path / "printed.diff")], cwd=root, check=True)
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--root", root, "--dry-run"]) == 0
    assert "applied" in capsys.readouterr().out


def test_json_report(make_tree, capsys):
    root = make_tree("0.26.0")
    assert apply.main(["--root", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "applied" and report["action"] == "applied"
    assert report["path"] == target(root) and report["diff"] == "v0.26.0.diff"
    assert report["sha256_before"] != report["sha256_after"]
    assert report["exit_code"] == 0 and report["version"] is None
    assert apply.main(["--root", root, "--check", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["action"] == "none" and again["sha256_before"] == report["sha256_after"]


def test_a_later_release_uses_the_diff_of_its_shape(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.28.0", name="site-packages")
    os.makedirs(os.path.join(site, "vllm-0.28.0.dist-info"))
    write(os.path.join(site, "vllm-0.28.0.dist-info", "METADATA"), b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.28.0\n")
    assert apply.main(["--root", site]) == 0
    assert "patches/v0.26.0.diff (vllm 0.28.0)" in capsys.readouterr().out


def test_installed_vllm_is_found_without_importing_it(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    write(os.path.join(site, "vllm", "__init__.py"), b"raise RuntimeError('no device on this node')\n")
    os.makedirs(os.path.join(site, "vllm-0.30.0.dist-info"))
    write(os.path.join(site, "vllm-0.30.0.dist-info", "METADATA"), b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.0\n")
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env={**os.environ, "PYTHONPATH": site},
                           capture_output=True, text=True)
    assert "no device on this node" in probe.stderr, "import vllm must fail here"

    monkeypatch.syspath_prepend(site)
    assert apply.main(["--check"]) == 1
    assert apply.main([]) == 0
    assert "(vllm 0.30.0)" in capsys.readouterr().out
    assert "vllm" not in sys.modules
    assert apply.main(["--check"]) == 0


def test_without_a_target(tmp_path, monkeypatch, capsys):
    assert apply.main(["--root", str(tmp_path)]) == 3
    assert "must be the directory holding vllm/" in capsys.readouterr().err
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert apply.main(["--check"]) == 3
    assert "no vllm package" in capsys.readouterr().err


def change_a_loop_line(data: bytes) -> bytes:
    return data.replace(b'logger.exception("WorkerProc hit an exception.")', b'logger.exception("Worker failed.")')


def half_applied(data: bytes) -> bytes:
    fix = next(f for f in apply.read_bundle() if f.name == "v0.33.0.diff")
    lines = apply.split_lines(data.decode())
    return apply.rewrite(lines, fix._replace(hunks=fix.hunks[:1])).encode()


DRIFTS = {
    "changed-loop-line": ("0.30.0", change_a_loop_line, "found:    '            logger.exception(\"Worker failed.\")'"),
    "crlf": ("0.26.0", lambda d: d.replace(b"\n", b"\r\n"), "CRLF line endings"),
    "empty": ("0.26.0", lambda d: b"", "the file is empty"),
    "not-utf8": ("0.30.0", lambda d: d.replace(b"WorkerProc hit", b"WorkerProc \xff hit"), "not UTF-8"),
    "half-applied": ("0.33.0", half_applied, "half-applied: v0.33.0.diff hunk 1 is in place"),
}


@pytest.mark.parametrize("case", sorted(DRIFTS))
def test_drifted_source_is_never_written(case, make_tree, capsys):
    version, mangle, reason = DRIFTS[case]
    root = make_tree(version)
    path = target(root)
    write(path, mangle(release_bytes(version)))
    drifted = read(path)
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 2, mode
        assert read(path) == drifted
        message = capsys.readouterr().err
        assert path in message and reason in message
        assert "v0.26.0.diff, v0.30.0.diff, v0.33.0.diff" in message
        assert hashlib.sha256(drifted).hexdigest() in message
    assert leftovers(root) == []


def test_symlinked_target_stays_a_link(make_tree, tmp_path):
    root = make_tree("0.30.0")
    real = tmp_path / "elsewhere" / "multiproc_executor.py"
    real.parent.mkdir()
    shutil.move(target(root), real)
    os.symlink(real, target(root))
    assert apply.main(["--root", root]) == 0
    assert os.path.islink(target(root))
    assert read(str(real)) == patched_bytes("0.30.0", tmp_path)
    assert apply.main(["--root", root, "--revert"]) == 0
    assert read(str(real)) == release_bytes("0.30.0") and os.path.islink(target(root))


def test_hard_linked_target_leaves_the_other_name(make_tree, tmp_path):
    root = make_tree("0.30.0")
    cache_copy = tmp_path / "uv-cache-copy.py"
    os.link(target(root), cache_copy)
    assert apply.main(["--root", root]) == 0
    assert read(str(cache_copy)) == release_bytes("0.30.0")
    assert read(target(root)) == patched_bytes("0.30.0", tmp_path)


def test_mode_is_kept(make_tree):
    root = make_tree("0.30.0")
    os.chmod(target(root), 0o640)
    assert apply.main(["--root", root]) == 0
    assert stat.S_IMODE(os.stat(target(root)).st_mode) == 0o640


def test_cached_bytecode_is_removed(make_tree):
    root = make_tree("0.30.0")
    path = target(root)
    pyc = py_compile.compile(path, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    other_python = os.path.join(os.path.dirname(pyc), "multiproc_executor.cpython-310.opt-1.pyc")
    shutil.copyfile(pyc, other_python)
    assert apply.main(["--root", root]) == 0
    assert not os.path.exists(pyc) and not os.path.exists(other_python)


def test_leftovers_of_a_killed_run_are_cleaned(make_tree):
    root = make_tree("0.30.0")
    directory = os.path.dirname(target(root))
    stale = os.path.join(directory, apply.TEMP_PREFIX + "killed.tmp")
    write(stale, b"half")
    assert apply.main(["--root", root, "--check"]) == 1
    assert os.path.exists(stale), "--check writes nothing, not even a clean-up"
    assert apply.main(["--root", root]) == 0
    assert leftovers(root) == []
    write(stale, b"half")  # killed during a later run, with the fix already in place
    assert apply.main(["--root", root]) == 0
    assert leftovers(root) == []


def test_kill_at_any_moment_leaves_old_or_new_bytes(make_tree, tmp_path):
    root = make_tree("0.30.0")
    path = target(root)
    old, new = release_bytes("0.30.0"), patched_bytes("0.30.0", tmp_path)
    rng = random.Random(7)
    for _ in range(12):
        write(path, old)
        child = subprocess.Popen([sys.executable, APPLY, "--root", root], stdout=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, 0.15))
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert read(path) in (old, new)
    assert apply.main(["--root", root]) == 0
    assert read(path) == new
    assert leftovers(root) == []


def test_concurrent_applies_serialize(make_tree, tmp_path):
    root = make_tree("0.33.0")
    runs = [subprocess.Popen([sys.executable, APPLY, "--root", root], stdout=subprocess.PIPE) for _ in range(8)]
    codes = [run.wait(timeout=60) for run in runs]
    for run in runs:
        run.stdout.close()
    assert codes == [0] * 8
    assert read(target(root)) == patched_bytes("0.33.0", tmp_path)
    assert leftovers(root) == []


def run_as_nobody(args: list[str], patches: str) -> int:
    """apply.main in a forked child that dropped root, as an operator without rights would run it."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            apply.PATCHES_DIR = patches
            os.setgid(65534)
            os.setuid(65534)
            code = apply.main(args)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_unwritable_target_is_a_clear_error(make_tree, capfd):
    public = tempfile.mkdtemp()  # pytest's tmp_path is private to root
    try:
        os.chmod(public, 0o755)
        root = os.path.join(public, "site")
        shutil.copytree(make_tree("0.30.0"), root)
        patches = os.path.join(public, "patches")
        shutil.copytree(apply.PATCHES_DIR, patches)
        for directory, _, _ in os.walk(public):
            os.chmod(directory, 0o755)
        if os.geteuid() == 0:
            check, change = run_as_nobody(["--root", root, "--check"], patches), run_as_nobody(["--root", root], patches)
        else:
            os.chmod(os.path.dirname(target(root)), 0o555)
            check, change = apply.main(["--root", root, "--check"]), apply.main(["--root", root])
        assert check == 1, "--check needs no write access"
        assert change == 4
        err = capfd.readouterr().err
        assert "cannot write in" in err and "Permission denied" in err and len(err.strip().splitlines()) == 1
        assert read(target(root)) == release_bytes("0.30.0")
        assert leftovers(root) == []
    finally:
        shutil.rmtree(public)


@pytest.mark.parametrize(
    "name, text, complaint",
    [
        ("truncated.diff", "TRUNCATED", "not a unified diff"),
        ("garbage.diff", "@@ this is not a diff\n+\n", "must change"),
        ("other-file.diff", "--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n", "must change"),
        ("empty.diff", "", "must change"),
    ],
)
def test_malformed_bundle(name, text, complaint, make_tree, tmp_path, monkeypatch, capsys):
    root = make_tree("0.30.0")
    patches = tmp_path / "patches"
    shutil.copytree(apply.PATCHES_DIR, patches)
    if text == "TRUNCATED":  # a copy cut short
        text = (patches / "v0.30.0.diff").read_text()[:2000]
    (patches / name).write_text(text)
    monkeypatch.setattr(apply, "PATCHES_DIR", str(patches))
    assert apply.main(["--root", root]) == 5
    assert complaint in capsys.readouterr().err
    assert read(target(root)) == release_bytes("0.30.0")


def test_missing_bundle(make_tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(apply, "PATCHES_DIR", str(tmp_path / "nowhere"))
    assert apply.main(["--root", make_tree("0.30.0"), "--check"]) == 5
    assert "cannot read the patch bundle" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--check", "--revert"], ["--diff", "--verify"], ["--bogus"], ["--root"], ["--root="], ["--root", "--check"], ["x"]]
)
def test_usage_errors_have_their_own_code(args, capsys):
    assert apply.main(args) == 6
    err = capsys.readouterr().err
    assert err.startswith("apply.py: usage error:") and len(err.strip().splitlines()) == 1


def test_root_takes_both_spellings(make_tree, capsys):
    root = make_tree("0.30.0")
    assert apply.main([f"--root={root}", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "would-apply"
    assert apply.main(["--check", "--root", root, "--check"]) == 1


def test_help_lists_every_exit_code(capsys):
    assert apply.main(["--help"]) == 0
    out = capsys.readouterr().out
    for code in range(9):
        assert f"\n  {code}  " in out


def test_script_runs_outside_its_directory(make_tree, tmp_path):
    root = make_tree("0.30.0")
    done = subprocess.run([sys.executable, APPLY, "--root", root, "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "v0.30.0.diff" in done.stdout
