"""Files an earlier bundle fixed (releases/superseded.tsv): known by their sha256, and taken
back to their release's text by that bundle's own diff (patches/superseded/), so that
apply puts this bundle's fix in their place and revert gives the release. Read only for a
file the release table does not know."""
from __future__ import annotations

import os

from . import bundle
from .bundle import parse_fix, read_table_text
from .match import fingerprint, rewrite, split_lines
from .outcome import APPLIED_STATE, BAD_BUNDLE, Failure
from .seal import sha256_hex
from .table import EarlierFix, read_earlier_fixes, read_releases


def earlier_fix(data: bytes) -> EarlierFix | None:
    """The row for a file an earlier bundle's diff made; None for any other (a release's
    file, or the one its diff makes, without reading the earlier fixes). Exit 5 if a table
    read is not whole or they disagree."""
    try:
        releases = read_releases(read_table_text())
    except ValueError as e:
        raise Failure(BAD_BUNDLE, f"releases/releases.tsv {e}") from None
    digest = sha256_hex(data)
    if any(digest in (release.sha256, release.fixed_sha256) for release in releases.values()):
        return None
    try:
        names = bundle.diff_names(bundle.EARLIER_DIR)
        with open(bundle.EARLIER_TABLE, encoding="utf-8", newline="") as f:
            earlier = read_earlier_fixes(f.read(), releases, names)
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the earlier fixes ({e}); copy the bundle again") from None
    except ValueError as e:
        raise Failure(BAD_BUNDLE, f"releases/superseded.tsv {e}") from None
    return earlier.get(digest)


def release_text(row: EarlierFix, text: str) -> str:
    """The release's text the file was made from, by the earlier diff taken back; exit 5
    unless that gives the release's bytes (a damaged bundle)."""
    name = f"superseded/{row.diff}"
    try:
        with open(os.path.join(bundle.EARLIER_DIR, row.diff), encoding="utf-8", newline="") as f:
            fix = parse_fix(name, f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read patches/{name}: {e}; copy the bundle again") from None
    lines = split_lines(text)
    released = rewrite(lines, fix, revert=True) if fingerprint(lines, fix) == APPLIED_STATE else None
    if released is None or sha256_hex(released.encode("utf-8")) != row.sha256:
        raise Failure(BAD_BUNDLE, f"patches/{name} does not take the file back to vllm {row.version}'s: copy the bundle again")
    return released
