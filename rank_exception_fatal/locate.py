"""Where the file is: the executor that Python would import under --root, on this Python's
sys.path, or as a running process (--pid) would import it, found without importing vLLM;
and its bytes, read."""
import os
import sys

from .outcome import CANNOT_READ_OR_WRITE, NOT_A_SOURCE_FILE, OTHER_MOUNT_NAMESPACE, TARGET, TARGET_NOT_FOUND, Failure

# Sequence is for annotations only: importing collections.abc costs the gate 2 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


class Located:
    """path: the executor's source file; pycache_prefix: where the process that imports it
    caches bytecode, if elsewhere than beside the file (None: beside it, or this Python's).
    (A plain class: see outcome.Report.)"""

    __slots__ = ("path", "pycache_prefix")

    def __init__(self, path: str, pycache_prefix: "str | None" = None) -> None:
        self.path, self.pycache_prefix = path, pycache_prefix

    def __repr__(self) -> str:
        return f"Located(path={self.path!r}, pycache_prefix={self.pycache_prefix!r})"


def locate_target(root: "str | None") -> str:
    """The source file Python would import as vllm's executor: under --root, or on this
    Python's sys.path. Searched as the import system searches (a namespace package's
    portions in order, a compiled module before the source, a zip), without running
    vllm/__init__.py, which needs torch and a device and may fail on a node being repaired."""
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
    source = isinstance(spec.loader, import_system_class("SourceFileLoader")) and spec.origin.endswith(
        os.sep + os.path.basename(TARGET))  # not a package's __init__.py
    tree = spec.origin[: -len(TARGET) - 1] if source and spec.origin.endswith(os.sep + TARGET) else None
    shadow = spec.origin if not source or tree is None else imported_instead(tree, TARGET, True)
    if shadow:
        raise Failure(NOT_A_SOURCE_FILE, not_a_source_words("executor", shadow))
    return spec.origin


def not_a_source_words(what: str, origin: str) -> str:
    return (f"Python imports vllm's {what} from {origin}, not from a source file this tool can fix"
            " (a compiled module, bytecode without its source, a package directory, or a zip); nothing was written")


def imported_instead(tree: str, relative: str, exists: bool, listings: "dict | None" = None) -> "str | None":
    """None if Python, importing the module at relative (vllm/.../name.py) from the tree
    holding vllm/, takes that source file, or (exists False: a file apply creates) finds
    nothing there to take instead; else what it takes instead. The import system's rule
    for a name in a directory (FileFinder's order: a package directory, then an extension
    module, then the source; a directory without __init__ only when none of these is
    there), read from each directory's listing; stricter in one way: an extension module
    built for any CPython counts, as the server's Python may be another than this one.
    listings: each directory's names, shared by the files of one decision."""
    listings = {} if listings is None else listings

    def names(directory: str) -> "set[str]":
        if directory not in listings:
            try:
                listings[directory] = set(os.listdir(directory))
            except OSError:  # not a directory, or none
                listings[directory] = set()
        return listings[directory]

    parts = relative[: -len(".py")].split("/")
    directory = tree
    for depth, name in enumerate(parts):
        here, package = names(directory), os.path.join(directory, name)
        inits = sorted(entry for entry in names(package) if entry.startswith("__init__.")) if name in here else []
        modules = sorted(entry for entry in here if entry.startswith(name + ".")
                         and (entry.endswith((".so", ".pyd")) or entry == name + ".py"))
        if depth < len(parts) - 1:  # a package on the way: its directory, unless a module takes the name
            if name not in here:
                return None if not exists else f"{package} (no such package)"
            if not inits and modules:
                return os.path.join(directory, modules[0])
        elif inits:
            return os.path.join(package, inits[0])
        else:
            compiled = [entry for entry in modules if entry != name + ".py"]
            if compiled:
                return os.path.join(directory, compiled[0])
            if exists and name + ".py" not in here:
                return f"{package}.py (not there)"
        directory = package
    return None


def import_system_class(name: str) -> type:
    """SourceFileLoader or ModuleSpec, as importlib.machinery names them: the import
    system's own classes, which CPython has loaded before any code runs (importing
    importlib.machinery for them would cost the gate a millisecond: importlib, warnings)."""
    for bootstrap in ("_frozen_importlib_external", "_frozen_importlib"):
        found = getattr(sys.modules.get(bootstrap), name, None)
        if found is not None:
            return found
    import importlib.machinery

    return getattr(importlib.machinery, name)


def read_target(path: str) -> "tuple[bytes, str | None]":
    """The file's bytes, and their text (None if they are not UTF-8)."""
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


def find_spec_in(name: str, locations: "Sequence[str]"):
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
    namespace = import_system_class("ModuleSpec")(name, None, is_package=True)
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
# that Python's import system finds the executor, with sys.path[0] as the process had
# it. It imports this package from the bundle (argv[1]) and then takes the bundle off
# sys.path again, so that only the process's own path is searched. It prints its
# answer as JSON: {"path": ..., "searched": [its absolute sys.path entries]} or
# {"code": ..., "message": ...}.
LOCATE_AS_PROCESS = """\
import json, sys
bundle, first = sys.argv[1:3]
sys.path.insert(0, bundle)
from rank_exception_fatal.locate import locate_target
from rank_exception_fatal.outcome import Failure
del sys.path[0]
if sys.path and sys.path[0] == "":  # -c put the working directory first; the process had its own
    sys.path[0] = first
try:
    print(json.dumps({"path": locate_target(None), "searched": [p for p in sys.path if p.startswith("/")]}))
except Failure as e:
    print(json.dumps({"code": e.code, "message": str(e)}))
"""


def locate_for_process(pid: str) -> Located:
    """The executor file a running process (the server) would import: found by its own
    interpreter, with its environment, working directory and first sys.path entry, all
    read from /proc. A server started elsewhere, with another PYTHONPATH, or from a
    directory holding a vLLM checkout may import a copy other than this Python's."""
    exe, cwd, environ, command, elsewhere = read_process(pid)
    deleted = cwd.endswith(" (deleted)")
    if deleted:  # an empty directory since removed: Python finds nothing there
        cwd = cwd[: -len(" (deleted)")]
    if elsewhere:  # its interpreter and working directory, the same files here, before it runs here
        sees_the_same_files(pid, [exe, cwd])
    python = interpreter_as_run(pid, exe, command, cwd, environ)
    flags, first, prefix = interpreter_view(command, cwd)
    # The removed directory is still its working directory, reached through /proc.
    run_in = f"/proc/{pid}/cwd" if deleted else cwd
    path, searched = ask_its_python(pid, python, flags, first or run_in, run_in, environ, cwd)
    if prefix is None and environ.get(b"PYTHONPYCACHEPREFIX") and not {"-E", "-I"} & set(flags):
        prefix = os.fsdecode(environ[b"PYTHONPYCACHEPREFIX"])
    located = Located(path, os.path.join(cwd, prefix) if prefix else None)
    if elsewhere:  # where it looks, the file, the directory a write renames into, its bytecode
        sees_the_same_files(pid, [*searched, path, os.path.dirname(path), located.pycache_prefix])
    return located


def read_process(pid: str) -> "tuple[str, str, dict, list[str], bool]":
    """(its executable, working directory, environment, command line, whether it runs in
    another mount namespace), from /proc; it must be a Python."""
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
    return exe, cwd, environ, command, namespace != os.readlink("/proc/self/ns/mnt")


def sees_the_same_files(pid: str, paths: "Sequence[str | None]") -> None:
    """Refuse a process in another mount namespace that sees another file (or none) at any
    of these paths than this one does. A container's paths may name other files: the
    host's copy would be checked, or written, in place of its own. A systemd unit with
    PrivateTmp=, ProtectSystem= and the like gets a namespace of its own too, but sees
    the very same files at the paths that matter: compared by device and inode."""
    for path in filter(None, paths):
        here = stat_or_none(pid, path)
        there = stat_or_none(pid, in_its_root(f"/proc/{pid}/root", path))
        if here is None and there is None or here and there and os.path.samestat(here, there):
            continue
        seen = "is another file than here" if here and there else "does not exist (here it does)" if here else (
            "exists (here it does not)")
        raise Failure(
            OTHER_MOUNT_NAMESPACE,
            f"process {pid} runs in another mount namespace (a container) where {path} {seen}: the files"
            " at its paths here are not the ones it imports; nothing was checked or written. Run apply.py inside"
            " it (docker exec, kubectl exec) with the server's Python",
        )


def stat_or_none(pid: str, path: str) -> "os.stat_result | None":
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise Failure(
            CANNOT_READ_OR_WRITE, f"cannot read {path} for process {pid}: {e.strerror}; run as its user or as root"
        ) from None


def in_its_root(root: str, path: str) -> str:
    """The path under root (/proc/PID/root) that the process resolves path to. Walked a
    component at a time: the kernel resolves an absolute link's target met under
    /proc/PID/root from our root, but the process resolves it from its own."""
    done, todo, hops = [], [part for part in reversed(path.split("/")) if part], 0
    while todo:
        part = todo.pop()
        if part in (".", ".."):
            done = done[:-1] if part == ".." else done  # no higher than its root
            continue
        here = "/".join([root, *done, part])
        try:
            is_link = os.path.islink(here) and hops < 40  # past the kernel's limit: stat says ELOOP
            to = os.readlink(here) if is_link else ""
        except OSError:
            is_link = False
        if not is_link:
            done.append(part)
            continue
        hops += 1
        done = [] if to.startswith("/") else done
        todo += [part for part in reversed(to.split("/")) if part]
    return "/".join([root, *done])


def ask_its_python(pid: str, python: str, flags: "list[str]", first: str, run_in: str, environ: dict,
                   cwd: str) -> "tuple[str, list[str]]":
    """locate_target(None), run by the process's Python as the process runs
    (LOCATE_AS_PROCESS), and the absolute sys.path entries it searched."""
    import json
    import subprocess

    bundle = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        found = subprocess.run(
            [python, *flags, "-c", LOCATE_AS_PROCESS, bundle, first],
            env={os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()},
            cwd=run_in, capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Failure(TARGET_NOT_FOUND, f"cannot run process {pid}'s Python {python}: {e}") from None
    try:
        answer = json.loads(found.stdout) if found.returncode == 0 else {}
    except ValueError:
        answer = {}
    if "path" in answer:
        return answer["path"], answer.get("searched", [])
    message = answer.get("message") or (found.stderr.strip().splitlines()[-1:] or [f"exit status {found.returncode}"])[0]
    code = answer.get("code") if answer.get("code") in (TARGET_NOT_FOUND, NOT_A_SOURCE_FILE) else TARGET_NOT_FOUND
    raise Failure(code, f"as process {pid} ({python}, in {cwd}) would import it: {message}")


def interpreter_as_run(pid: str, exe: str, command: "Sequence[str]", cwd: str, environ: dict) -> str:
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


def interpreter_view(command: "Sequence[str]", cwd: str) -> "tuple[list[str], str, str | None]":
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
