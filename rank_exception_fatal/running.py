"""Whether a running server loaded the file as it is now (--check --pid), and marking the
file changed when bytecode it may have run is removed."""
from __future__ import annotations

import os

from .outcome import NEEDS_RESTART_STATE, NOT_APPLIED, Report


# Seconds within which a process's start and a file's change are too close to order
# (clock ticks of 10 ms, a kernel's coarse file time a tick behind), and on a file
# system that stamps whole seconds.
RESTART_MARGIN, WHOLE_SECONDS_MARGIN = 0.1, 2.0


def started_after_change(pid: str, path: str) -> str | None:
    """None if the code process pid runs was loaded after path last changed (written, or
    its stale bytecode removed: apply.py then marks the file changed) and after each link
    on the paths it resolved at its start last changed; else why not. A process that
    started before runs the code it loaded then; a link switched since (blue/green trees,
    a linked virtualenv) named other files when it resolved it.

    The start is read from /proc/PID/stat (clock ticks since boot, rounded down: the true
    start is no earlier) of the process, or of the one it was forked from without exec
    (whose loaded code a fork inherits); the changes from the file's ctime and mtime and
    each link's, which the kernel stamps from a clock up to a tick behind, and whole
    seconds on some file systems. Within a margin for both, the answer is no: when unsure,
    not 0."""
    import time

    changes = links_changed(pid, path)
    if isinstance(changes, str):
        return changes
    changed = last_change(path)
    if isinstance(changed, str):
        return changed
    loaded = code_loaded_by(pid)
    if loaded is None:
        return f"the start of process {pid} cannot be read"
    origin, ticks = loaded
    # Both on the boot clock: the wall clock's offset from it, now.
    offset = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    started = ticks / os.sysconf("SC_CLK_TCK") + offset
    who = f"process {pid}" if origin == pid else f"process {pid} was forked (without exec) from process {origin}, which"
    for what, (when, margin) in (*changes, (path, changed)):  # a link first: the surprise
        if started > when + margin:
            continue
        if started > when:
            return (
                f"{who} started at {wall_time(started)}, within {margin:g} s after {what} last changed"
                f" ({wall_time(when)}): too close to tell which code it loaded"
            )
        return f"{who} started at {wall_time(started)}, before {what} last changed ({wall_time(when)})"
    return None


def last_change(path: str) -> tuple[float, float] | str:
    """(when the file or its link last changed, the margin its file system's stamps need),
    or why it cannot be read."""
    changed = 0.0
    whole_seconds = False
    for stat in (os.stat, os.lstat):
        try:
            st = stat(path)
        except OSError as e:
            return f"{path} cannot be read ({e.strerror})"
        changed = max(changed, st.st_ctime, st.st_mtime)
        whole_seconds = whole_seconds or st.st_ctime_ns % 1_000_000_000 == 0
    return changed, WHOLE_SECONDS_MARGIN if whole_seconds else RESTART_MARGIN


def links_changed(pid: str, path: str) -> list[tuple[str, tuple[float, float]]] | str:
    """Each link the process followed at its start to reach its code, as ("the link L (now
    to T)", (when it last changed, its margin)); or why they cannot be read. A link is
    replaced, not edited (ln -sfn, or a new link renamed over it: a new change time), so
    one that changed after the start named other files then."""
    found, seen = [], set()
    for start_path in paths_resolved_at_start(pid, path):
        links = links_followed(start_path)
        if isinstance(links, str):
            return links
        for link, to, st in links:
            if link not in seen:
                seen.add(link)
                whole_seconds = st.st_ctime_ns % 1_000_000_000 == 0
                when = max(st.st_ctime, st.st_mtime), WHOLE_SECONDS_MARGIN if whole_seconds else RESTART_MARGIN
                found.append((f"the link {link} (now to {to})", when))
    return found


def paths_resolved_at_start(pid: str, path: str) -> list[str]:
    """The paths by which the process reached the file: the file's own; the interpreter as
    started (its virtualenv is found beside it); its script (sys.path[0] is the script's
    real directory, resolved then); its PYTHONPATH. Its working directory needs none:
    /proc names the directory it holds, resolved at its start."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = [os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1]]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(entry.partition(b"=")[::2] for entry in f.read().split(b"\0") if b"=" in entry)
    except OSError:
        return [path]  # gone: the file's own path is still checked
    paths = [path]
    argv0 = command[0] if command else ""
    if "/" in argv0:
        paths.append(os.path.join(cwd, argv0))
    elif argv0:  # found on its PATH, as exec found it: the first that exists
        for directory in (os.fsdecode(environ.get(b"PATH", b"")) or os.defpath).split(os.pathsep):
            candidate = os.path.join(cwd, directory, argv0)
            paths.append(candidate)
            if os.path.exists(candidate):
                break
    script = script_of(command[1:])
    if script:
        paths.append(os.path.join(cwd, script))
    entries = os.fsdecode(environ.get(b"PYTHONPATH", b""))
    paths += [os.path.join(cwd, entry) for entry in entries.split(os.pathsep) if entry]
    return paths


def script_of(args: list[str]) -> str | None:
    """The script a Python command line runs (None for -m, -c or stdin)."""
    while args and args[0].startswith("-") and args[0] not in ("-", "-m", "-c"):
        option = args.pop(0)
        if option in ("-W", "-X", "--check-hash-based-pycs") and args:
            args.pop(0)  # its value
        elif option[1:2] not in ("W", "X") and any(letter in "cm" for letter in option[2:]):
            return None  # -Ic, -Bm: a letter that takes the rest
    return args[0] if args and args[0] not in ("-", "-m", "-c") else None


def links_followed(path: str) -> list[tuple[str, str, os.stat_result]] | str:
    """Each link the kernel follows to resolve the absolute path, in order, with its target
    and lstat;
    or why one cannot be read. Walked a component at a time, as the kernel walks it: a
    link's target goes on from the link's directory, or from / if absolute."""
    import stat

    links, done, todo = [], "/", [part for part in reversed(path.split("/")) if part]
    while todo:
        part = todo.pop()
        if part == "..":
            done = os.path.dirname(done)
            continue
        here = os.path.join(done, part) if part != "." else done
        try:
            st = os.lstat(here)
            if not stat.S_ISLNK(st.st_mode):
                done = here
                continue
            to = os.readlink(here)
        except FileNotFoundError:
            return links  # the rest does not exist now: nothing more to follow
        except OSError as e:
            return f"{here}, on the path to its code, cannot be read ({e.strerror})"
        if len(links) == 40:  # the kernel's limit too (ELOOP)
            return f"{path} cannot be resolved: too many links"
        links.append((here, to, st))
        done = "/" if to.startswith("/") else done
        todo += [part for part in reversed(to.split("/")) if part]
    return links


def code_loaded_by(pid: str) -> tuple[str, int] | None:
    """(the pid, its start in clock ticks since boot) of the process whose loaded code pid
    runs: pid itself, or the earliest of the ancestors it was forked from without exec
    (same executable and command line, and the same start of code and of stack: exec lays
    out a fresh process at random places, a fork copies its parent's). Not a manager that
    ran the server (fork and exec), Python as it may be: the server loaded its code anew.
    None if the process's start cannot be read."""
    found = None
    current, program = pid, None
    for _ in range(64):
        try:
            with open(f"/proc/{current}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{current}/cmdline", "rb") as f:
                command = f.read()
            exe = os.readlink(f"/proc/{current}/exe")
        except OSError:
            break
        # The executable, the command line, and where its code and stack start (shown to
        # whoever may read its executable's link, as above).
        this = (exe, command, fields[23], fields[25])
        if program is not None and this != program:
            break  # exec'd anew: its code is its own
        program = this
        found = (current, int(fields[19]))
        current = fields[1]  # its parent
    return found


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


def as_running(pid: str, path: str, report: Report, what: str = "the file") -> Report:
    """--check --pid: 0 only if the running process loaded the file as it is now (what: the
    file, or the fix whose files the caller asks in turn)."""
    why = started_after_change(pid, path)
    if why is None:
        return report
    message = f"needs restart: {what} reads {report.state} ({report.message}), but {why}: it runs the code it loaded then; restart the server"
    return report.replaced(code=NOT_APPLIED, state=NEEDS_RESTART_STATE, message=message)
