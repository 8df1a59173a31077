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

# Every file of the package, and the loop test beside it, by its size in bytes: any of
# them a run may import (each mode imports its own, a child the probe's). apply.py refuses
# a bundle copied without one, or with one cut short (cut at a line's end it may still
# compile, and end a run with a wrong answer): exit 5 in one line, before the run begins.
# tests/test_apply.py checks these against the files and prints them anew after an edit.
FILES = {"../test_rank_exception_fatal.py": 41540, "adapt.py": 6038, "bindings.py": 5841, "bundle.py": 6367,
         "bytecode.py": 3566, "change.py": 11700, "check.py": 6876, "children.py": 1886, "cli.py": 15253,
         "decide.py": 1821, "disk.py": 7562, "drift.py": 5559, "earlier.py": 7030, "exit_path.py": 18105,
         "fileset.py": 16435, "hooks.py": 6127, "installed.py": 11677, "judged.py": 5223, "leftover.py": 2866,
         "locate.py": 18703, "loop_probe/__init__.py": 499, "loop_probe/cases.py": 10123, "loop_probe/child.py": 10149,
         "loop_probe/extract.py": 15675, "loop_probe/stand_ins.py": 2185, "match.py": 4039, "outcome.py": 4042,
         "proof.py": 7386, "reports.py": 2929, "running.py": 10388, "seal.py": 1135, "spawn.py": 1130,
         "table.py": 15685, "verify.py": 16392}


def damaged_file() -> "str | None":
    """The first of FILES missing or of another size, as its path in the bundle; None if
    the package is whole."""
    import os

    here = os.path.dirname(os.path.realpath(__file__))
    for name, size in FILES.items():
        try:
            if os.stat(os.path.join(here, name)).st_size == size:
                continue
            return f"{os.path.normpath(os.path.join('rank_exception_fatal', name))} is cut short or changed"
        except OSError:
            return f"{os.path.normpath(os.path.join('rank_exception_fatal', name))} is missing"
    return None


def of_the_bundle(error: BaseException) -> bool:
    """Whether an ImportError or SyntaxError met during a run is a module of this package
    that cannot be loaded (damaged after the start check): a bundle fault, exit 5."""
    import os

    package = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")
    where = getattr(error, "filename", None) or getattr(error, "path", None) or ""
    return (getattr(error, "name", None) or "").startswith(__name__) or os.path.realpath(where).startswith(package)
