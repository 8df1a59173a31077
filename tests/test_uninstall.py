"""`pip uninstall` after apply.py, on a real pip in a real virtualenv, with a wheel of the
release's own files: apply lists the module it creates in the wheel's RECORD (with its
hash and size), so pip removes it with the rest and `import vllm` fails afterwards; revert
gives RECORD back byte for byte; and a module left by a bundle that did not list it is
named by --check and removed by --revert."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

import fetch_release
from helpers import read, run_apply, write
from rank_exception_fatal.exit_path import HELPER

VERSION = "0.30.0"
FILES = ["vllm/v1/executor/multiproc_executor.py", *(path for path, _ in fetch_release.exit_path_files(VERSION))]


def wheel_of_the_release(directory) -> str:
    """A wheel named vllm holding the release's files of the fix and its packages' __init__.py."""
    tree = fetch_release.release_tree(VERSION)
    files = {path: read(os.path.join(tree, path)) for path in FILES}
    for path in FILES:
        parts = path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            files.setdefault("/".join(parts[:depth] + ["__init__.py"]), b"")
    info = f"vllm-{VERSION}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/top_level.txt"] = b"vllm\n"
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = os.path.join(directory, f"vllm-{VERSION}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


@pytest.fixture
def venv(tmp_path) -> tuple[str, str]:
    """(its Python, its site-packages) with the wheel installed by pip."""
    # Without a pip of its own (ensurepip costs seconds): this Python's pip works on it (--python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    pip(python, "install", "--no-index", "--no-deps", wheel_of_the_release(str(tmp_path)))
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, site


def importable(python: str) -> bool:
    found = subprocess.run([python, "-c", "import importlib.util; print(importlib.util.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, check=True, cwd="/")
    return found.stdout.strip() == "True"


def record_of(site: str) -> str:
    return os.path.join(site, f"vllm-{VERSION}.dist-info", "RECORD")


def pip(python: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "--quiet", "--disable-pip-version-check", *args],
                   check=True, cwd="/")


def uninstall(python: str) -> None:
    pip(python, "uninstall", "-y", "vllm")


def test_pip_uninstall_removes_the_module_apply_created(venv):
    python, site = venv
    done = run_apply("--root", site)
    assert done.returncode == 0, done.stderr
    assert f"listed {HELPER} in {record_of(site)}" in done.stdout
    helper = read(os.path.join(site, HELPER))
    row = f"{HELPER},sha256={base64.urlsafe_b64encode(hashlib.sha256(helper).digest()).rstrip(b'=').decode()},{len(helper)}"
    assert f"\r\n{row}\r\n" in read(record_of(site)).decode(), "a row of its own, with the line ends pip wrote"
    again = run_apply("--root", site)
    assert (again.returncode, again.stdout.count("listed")) == (0, 0), "a second run writes nothing"
    assert run_apply("--root", site, "--check").returncode == 0
    assert importable(python)
    uninstall(python)
    assert not os.path.exists(os.path.join(site, "vllm")), sorted(os.listdir(site))
    assert not importable(python)


def test_revert_gives_record_back_byte_for_byte(venv):
    python, site = venv
    before = read(record_of(site))
    assert run_apply("--root", site).returncode == 0
    done = run_apply("--root", site, "--revert")
    assert done.returncode == 0 and f"took {HELPER} out of {record_of(site)}" in done.stdout, done
    assert read(record_of(site)) == before
    uninstall(python)
    assert not importable(python)


def test_a_module_left_by_an_earlier_bundle_is_named_and_revert_removes_it(venv):
    """A bundle before this one did not list the module: pip leaves it, and vllm/ with it."""
    python, site = venv
    record = read(record_of(site))
    assert run_apply("--root", site).returncode == 0
    write(record_of(site), record)  # as an earlier bundle left it: the module unlisted
    subprocess.run([python, "-c", "import vllm.entrypoints._rank_exception_fatal"], check=True, cwd="/")  # its .pyc
    uninstall(python)
    assert importable(python), "the case this test is about: pip left the module"
    check = run_apply("--check", python=python)
    assert check.returncode == 3 and len(check.stderr.splitlines()) == 1, check
    assert f"{os.path.join(site, HELPER)}, the module apply.py creates, is left" in check.stderr
    assert "apply.py --revert removes it" in check.stderr
    revert = run_apply("--revert", python=python)
    assert revert.returncode == 0 and f"removed {os.path.join(site, HELPER)}" in revert.stdout, revert
    assert not os.path.exists(os.path.join(site, "vllm")) and not importable(python)
    assert run_apply("--revert", python=python).returncode == 3


def test_a_left_module_of_other_bytes_is_not_removed(venv):
    python, site = venv
    uninstall(python)
    other = os.path.join(site, HELPER)
    os.makedirs(os.path.dirname(other))
    write(other, b"# another program's\n")
    done = run_apply("--root", site, "--revert")
    assert done.returncode == 3 and "holds other bytes than apply.py writes" in done.stderr, done
    assert read(other) == b"# another program's\n"


def test_a_record_another_program_rewrites_during_the_run_is_kept(venv, monkeypatch, capsys):
    """pip rewriting RECORD while apply runs: exit 9, RECORD as pip left it, nothing of the fix written."""
    import apply
    from rank_exception_fatal import fileset

    _, site = venv
    decided = fileset.record_change

    def then_pip_writes(*args):
        change = decided(*args)
        write(record_of(site), read(record_of(site)) + b"vllm/other.py,,\r\n")
        return change

    monkeypatch.setattr(fileset, "record_change", then_pip_writes)
    pip_wrote = read(record_of(site)) + b"vllm/other.py,,\r\n"
    assert apply.main(["--root", site]) == 9
    assert "changed while apply.py ran" in capsys.readouterr().err
    assert read(record_of(site)) == pip_wrote
    assert not os.path.exists(os.path.join(site, HELPER))
