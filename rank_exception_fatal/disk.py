"""The disk: the lock on the file's directory, and the one write primitive (an
adjacent temporary file with the old one's owner, mode, ACL and extended attributes,
swapped in with os.replace)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from .outcome import CANNOT_READ_OR_WRITE, TARGET, TARGET_NOT_FOUND, Failure

TEMP_PREFIX = ".rank-exception-fatal-"


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


def new_file_like(path: str, like: str | None = None) -> tuple[int, str]:
    """A temporary file beside path, with the owner, group and mode of path (or, for a file
    to create, of the file like, beside it): (fd, name)."""
    import stat
    import tempfile

    directory = os.path.dirname(path)
    like = like or path
    try:
        old = os.stat(like)
    except FileNotFoundError:
        raise Failure(TARGET_NOT_FOUND, f"{like} is gone: it was removed during the run") from None
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
                    f"cannot keep the owner and group of {like} (uid {old.st_uid}, gid {old.st_gid}):"
                    " run as its owner or as root",
                ) from None
        os.fchmod(fd, stat.S_IMODE(old.st_mode))  # after fchown, which clears set-id bits
        copy_extended_attributes(like, fd)  # after fchmod, which would reset an ACL's mask
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


def check_writable(path: str, like: str | None = None) -> None:
    """Fail as replace_file would, writing nothing: for --dry-run, and before a set of files is written."""
    fd, temp = new_file_like(path, like)
    os.close(fd)
    remove_files([temp])


def replace_file(path: str, data: bytes, like: str | None = None) -> None:
    """Swap in the new bytes all at once, with the old file's mode, owner and group (or,
    to create path, those of the file like), and make the swap durable."""
    fd, temp = new_file_like(path, like)
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
    sync_directory(os.path.dirname(path))


def remove_file(path: str) -> None:
    """Remove a file, durably: a later write must not stand on disk without this."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise Failure(CANNOT_READ_OR_WRITE, f"cannot remove {path}: {e.strerror}") from None
    sync_directory(os.path.dirname(path))


def sync_directory(directory: str) -> None:
    """Make a rename or removal in directory durable; the change itself is already done."""
    from contextlib import suppress

    with suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
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


def refuse_a_shared_file(path: str, relative: str = TARGET) -> None:
    """A file of the fix (at relative in its tree) that leads by a symlink out of the tree
    holding its vllm/ (a file or a directory linked into a store, as uv's
    --link-mode=symlink makes) is shared: a write would change every environment linked to
    it. The operator chooses which to fix."""
    def holding_vllm(file: str) -> str:
        return file[: -len(relative) - 1] or os.sep

    real = os.path.realpath(path)
    tree = holding_vllm(path)
    if real.startswith(os.path.join(os.path.realpath(tree), "")):
        return
    everyone = f"; or all that share it: --root {holding_vllm(real)}" if real.endswith(os.sep + relative) else ""
    raise Failure(
        CANNOT_READ_OR_WRITE,
        f"{path} is a link to {real}, outside {tree}: a file other environments may share;"
        f" nothing was written. Fix this one: cp --remove-destination {real} {path}, then run again{everyone}",
    )
