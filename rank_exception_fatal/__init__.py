"""rank-exception-fatal: the fix for vLLM's multiproc executor, its gate and its proof.

apply.py runs cli.main. The pipeline, module by module: locate (where the file is) ->
bundle and table (the diffs and the releases; check decides a file the table knows by
its sha256 alone, the gate's usual case; earlier takes a file an earlier bundle fixed
back to its release), match, bindings, adapt and decide (which diff fits, on which
side) -> drift and reports (why none, in words) -> proof and judged (asking the loop
probe, the loop_probe package, in children that spawn starts) ->
change (plan, then the one write primitive in disk) and bytecode; check is the gate,
verify runs the installed vLLM's own loop. outcome holds the vocabulary every module
speaks. Standard library only (unidiff parses a diff, once one must be parsed)."""

# Every module of the package, any of which a run may import (each mode imports its own, a
# child imports the probe's): apply.py refuses a bundle copied without one, exit 5 in one
# line, before the run begins, not with a traceback halfway through it (the list is checked
# against the package by tests/test_apply.py).
MODULES = ("adapt", "bindings", "bundle", "bytecode", "change", "check", "children", "cli", "decide", "disk",
           "drift", "earlier", "exit_path", "fileset", "hooks", "installed", "judged", "leftover", "locate", "match",
           "outcome", "proof", "reports", "running", "seal", "spawn", "table", "verify", "loop_probe/__init__",
           "loop_probe/cases", "loop_probe/child", "loop_probe/extract", "loop_probe/stand_ins")


def missing_module() -> "str | None":
    """The first of MODULES that is not beside this file, as its path in the bundle; None
    if the package is whole."""
    import os

    here = os.path.dirname(os.path.realpath(__file__))
    probe = os.path.join(here, "loop_probe")
    present = {*os.listdir(here), *(f"loop_probe/{name}" for name in (os.listdir(probe) if os.path.isdir(probe) else ()))}
    missing = [module for module in MODULES if f"{module}.py" not in present]
    return f"rank_exception_fatal/{missing[0]}.py" if missing else None


def of_the_bundle(error: BaseException) -> bool:
    """Whether an ImportError or SyntaxError met during a run is a module of this package
    that cannot be loaded (damaged after the start check): a bundle fault, exit 5."""
    import os

    package = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")
    where = getattr(error, "filename", None) or getattr(error, "path", None) or ""
    return (getattr(error, "name", None) or "").startswith(__name__) or os.path.realpath(where).startswith(package)
