"""Files an earlier bundle fixed, on the real bytes of releases and builds: every row of
releases/superseded.tsv is the file its diff makes of the release or build (and comes
from this repository's history), --check says not applied, apply.py puts this bundle's fix in its
place, --diff shows that change, and --revert gives the release's bytes; a damaged
earlier diff or table is a malformed bundle, and the file is left as it was."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import apply
from conftest import TARGET, release_bytes
from fetch_release import TABLE_ROWS, build_name, build_tree, read_builds, release_tree
from rank_exception_fatal import bundle, earlier, match, table
from supersede import earlier_fixes

with open(bundle.EARLIER_TABLE, encoding="utf-8") as f:
    EARLIER = table.read_earlier_fixes(f.read(), TABLE_ROWS, bundle.diff_names(bundle.EARLIER_DIR))
BUILDS = {build_name(build): build for build in read_builds()}
NAMED = os.environ.get("RANK_EXCEPTION_FATAL_RELEASES") == "named"
# Each earlier diff once, on the first release or build it fixed; under 3.10 and 3.13 (the
# named matrix, as tests/test_releases.py) only those of the releases each diff is named after.
CASES = {}
for row in EARLIER.values():
    if not NAMED or (row.version in TABLE_ROWS and TABLE_ROWS[row.version].diff == f"v{row.version}.diff"):
        CASES.setdefault(row.diff, row)


def source_bytes(row: table.EarlierFix) -> bytes:
    """The release's or build's own file, which the earlier diff was applied to."""
    if row.version in TABLE_ROWS:
        return release_bytes(row.version)
    return Path(build_tree(BUILDS[row.version]), TARGET).read_bytes()


def today_s_fixed_sha256(row: table.EarlierFix) -> str:
    """What this bundle makes of the row's release or build (a build's, with the diff that fits it)."""
    if row.version in TABLE_ROWS:
        return TABLE_ROWS[row.version].fixed_sha256
    build = BUILDS[row.version]
    with open(os.path.join(bundle.PATCHES_DIR, build.diff), encoding="utf-8", newline="") as f:
        fix = bundle.parse_fix(build.diff, f.read())
    return sha256(match.rewrite(match.split_lines(source_bytes(row).decode("utf-8")), fix).encode("utf-8"))


def make_source_tree(tmp_path, row: table.EarlierFix) -> str:
    """A tree holding the release's or build's own files: the executor the earlier diff was
    applied to, and the exit path's launcher and server file."""
    root = tmp_path / "tree"
    source = release_tree(row.version) if row.version in TABLE_ROWS else build_tree(BUILDS[row.version])
    shutil.copytree(os.path.join(source, "vllm"), root / "vllm")
    assert (root / TARGET).read_bytes() == source_bytes(row)
    return str(root)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def earlier_bytes(row: table.EarlierFix) -> bytes:
    """The file the earlier diff makes of the release, made here with the bundle's own matching."""
    with open(os.path.join(bundle.EARLIER_DIR, row.diff), encoding="utf-8", newline="") as f:
        fix = bundle.parse_fix(f"superseded/{row.diff}", f.read())
    lines = match.split_lines(source_bytes(row).decode("utf-8"))
    assert match.fingerprint(lines, fix) == "not-applied", row
    return match.rewrite(lines, fix).encode("utf-8")


def test_each_row_is_the_file_its_diff_makes_and_its_diff_takes_it_back():
    assert EARLIER, "releases/superseded.tsv lists no file"
    for row in EARLIER.values():
        if NAMED and row.version not in TABLE_ROWS:
            continue  # the builds' files: under the whole matrix
        made = earlier_bytes(row)
        assert sha256(made) == row.fixed_sha256, row
        assert earlier.release_text(row, made.decode("utf-8")).encode("utf-8") == source_bytes(row), row


if not NAMED:  # it reads every build's file, which the named matrix does not fetch
    def test_the_rows_are_what_this_repository_s_history_made():
        """scripts/supersede.py, run on the history, gives the committed table and diffs: a
        diff changed without it leaves the files of the bundle before it unknown, and fails here."""
        rows, files = earlier_fixes()
        assert {row[3]: row for row in rows} == {digest: [r.version, r.diff, r.sha256, r.fixed_sha256]
                                                 for digest, r in EARLIER.items()}
        for name, text in files.items():
            assert Path(bundle.EARLIER_DIR, name).read_text(encoding="utf-8") == text, name
        assert sorted(files) == bundle.diff_names(bundle.EARLIER_DIR)


def write(root: str, data: bytes) -> None:
    Path(root, TARGET).write_bytes(data)


def read(root: str) -> bytes:
    return Path(root, TARGET).read_bytes()


@pytest.mark.parametrize("name", sorted(CASES))
def test_apply_puts_this_bundle_s_fix_in_place_of_an_earlier_one(name, tmp_path, capsys):
    row = CASES[name]
    root = make_source_tree(tmp_path, row)
    made = earlier_bytes(row)
    write(root, made)
    assert apply.main(["--root", root, "--check"]) == 1
    out = capsys.readouterr().out
    assert f"an earlier bundle's fix (patches/superseded/{name}); apply.py puts patches/" in out, out
    assert apply.main(["--root", root, "--diff"]) == 0
    assert "+++ b/" + TARGET in capsys.readouterr().out
    assert read(root) == made, "--diff writes nothing"
    assert apply.main(["--root", root]) == 0
    assert f"in place of an earlier bundle's fix (patches/superseded/{name})" in capsys.readouterr().out
    assert sha256(read(root)) == today_s_fixed_sha256(row)
    assert apply.main(["--root", root, "--check"]) == 0
    write(root, made)
    assert apply.main(["--root", root, "--revert", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["diff"] == f"superseded/{name}"
    assert read(root) == source_bytes(row)


def some_case() -> table.EarlierFix:
    return CASES[sorted(CASES)[-1]]


def damaged_diff(tmp_path, monkeypatch, row):
    copy = tmp_path / "superseded"
    shutil.copytree(bundle.EARLIER_DIR, copy)  # with its helper/ folder
    damaged = copy / row.diff
    damaged.write_text(damaged.read_text(encoding="utf-8").replace("+", "-", 1), encoding="utf-8")
    monkeypatch.setattr(bundle, "EARLIER_DIR", str(copy))


def damaged_table(tmp_path, monkeypatch, row):
    copy = tmp_path / "superseded.tsv"
    copy.write_text(Path(bundle.EARLIER_TABLE).read_text(encoding="utf-8").replace(row.fixed_sha256[:8], "0" * 8),
                    encoding="utf-8")
    monkeypatch.setattr(bundle, "EARLIER_TABLE", str(copy))


def resealed_other_diff(tmp_path, monkeypatch, row):
    """A row whose diff is another's, sealed again: the diff does not give the release back."""
    from supersede import sealed

    other = next(r for r in EARLIER.values() if r.version != row.version)
    text = Path(bundle.EARLIER_TABLE).read_text(encoding="utf-8")
    body = text.partition("\n")[2].replace(f"\t{row.diff}\t{row.sha256}\t{row.fixed_sha256}",
                                           f"\t{other.diff}\t{row.sha256}\t{row.fixed_sha256}")
    copy = tmp_path / "superseded.tsv"
    copy.write_text(sealed(body), encoding="utf-8")
    monkeypatch.setattr(bundle, "EARLIER_TABLE", str(copy))


@pytest.mark.parametrize("damage, complaint", [
    (damaged_diff, "is cut short or damaged"),
    (damaged_table, "releases/superseded.tsv is cut short or damaged"),
    (resealed_other_diff, "does not take the file back to vllm"),
], ids=["damaged-diff", "damaged-table", "another-row-s-diff"])
def test_a_damaged_earlier_fix_is_a_malformed_bundle(damage, complaint, make_tree, tmp_path, monkeypatch, capsys):
    row = some_case()
    made = earlier_bytes(row)
    damage(tmp_path, monkeypatch, row)
    root = make_tree(row.version)
    write(root, made)
    for mode in (["--check"], [], ["--revert"], ["--diff"]):
        assert apply.main(["--root", root, *mode]) == 5, mode
        err = capsys.readouterr().err
        assert complaint in err and len(err.strip().splitlines()) == 1, err
        assert read(root) == made, mode


def test_a_known_file_needs_no_earlier_fix(make_tree, tmp_path, monkeypatch, capsys):
    """A release's file and the one its diff makes never read the earlier fixes: a bundle
    copied without them still checks, applies and reverts those."""
    monkeypatch.setattr(bundle, "EARLIER_DIR", str(tmp_path / "no-superseded"))
    monkeypatch.setattr(bundle, "EARLIER_TABLE", str(tmp_path / "no-superseded.tsv"))
    root = make_tree("0.30.0")
    for mode, code in ((["--check"], 1), (["--diff"], 0), ([], 0), (["--check"], 0), ([], 0), (["--revert"], 0)):
        assert apply.main(["--root", root, *mode]) == code, (mode, capsys.readouterr())
    assert read(root) == release_bytes("0.30.0")
