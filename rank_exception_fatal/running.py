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
    """None if process pid, and each process of its session it was forked from (whose
    loaded code a fork inherits), started after path last changed (written, or its stale
    bytecode removed: apply.py then marks the file changed); else why not. A process that
    started before runs the code it loaded then.

    The start is read from /proc/PID/stat (clock ticks since boot, rounded down: the true
    start is no earlier), the change from the file's ctime and mtime and the link's, which
    the kernel stamps from a clock up to a tick behind, and whole seconds on some file
    systems. Within a margin for both, the answer is no: when unsure, not 0."""
    import time

    changed = last_change(path)
    if isinstance(changed, str):
        return changed
    changed, margin = changed
    start = session_start_ticks(pid)
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


def session_start_ticks(pid: str) -> int | None:
    """The earliest start, in clock ticks since boot, of the process and of each Python
    process of its session it was forked from; None if it cannot be read."""
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
    return start


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


def as_running(pid: str, path: str, report: Report) -> Report:
    """--check --pid: 0 only if the running process loaded the file as it is now."""
    why = started_after_change(pid, path)
    if why is None:
        return report
    message = f"needs restart: the file reads {report.state} ({report.message}), but {why}: it runs the code it loaded then; restart the server"
    return report.replaced(code=NOT_APPLIED, state=NEEDS_RESTART_STATE, message=message)
