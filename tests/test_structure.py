"""The package's shape, as the design names it: the gate's fast path imports only what it
needs, the pipeline's decisions are pure functions over text (tested here without a
process or a file), and no module loads another by path."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import release_bytes
from fetch_release import TABLE_ROWS
from helpers import APPLY, BUNDLE
from rank_exception_fatal import adapt, bundle, decide, drift, match
from rank_exception_fatal.outcome import APPLIED_STATE, DRIFTED_STATE, NOT_APPLIED_STATE

# Run apply.py as an operator does, then list what it imported.
IMPORTED = """\
import sys
before = set(sys.modules)
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"), {"__name__": "__main__", "__file__": sys.argv[0]})
except SystemExit as e:
    code = e.code
imported = sorted(set(sys.modules) - before)
import json
print(json.dumps({"code": code, "imported": imported}))
"""
# Beyond its own modules, the gate loads only CPython's sha256 (_sha256 before 3.12) and
# gc, built in: each other module costs it a part of a millisecond or more to import.
GATE_STDLIB = {"_sha2", "_sha256", "gc"}
GATE_MODULES = {"rank_exception_fatal", *(f"rank_exception_fatal.{m}" for m in (
    "cli", "outcome", "locate", "seal", "check", "bundle", "table", "fileset", "exit_path"))}
FIXED_FILE_GATE_MODULES = {*GATE_MODULES, "rank_exception_fatal.bytecode"}  # stale .pyc could run instead


@pytest.mark.parametrize("fixed", [False, True], ids=["not-applied", "applied"])
def test_the_gate_on_a_known_file_imports_only_what_it_needs(fixed, make_tree):
    root = make_tree("0.30.0")
    if fixed:
        assert subprocess.run([sys.executable, APPLY, "--root", root], capture_output=True).returncode == 0
    done = subprocess.run([sys.executable, "-c", IMPORTED, APPLY, "--check", "--root", root],
                          capture_output=True, text=True, timeout=60)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["code"] == (0 if fixed else 1), done.stdout
    imported = set(answer["imported"])
    modules = FIXED_FILE_GATE_MODULES if fixed else GATE_MODULES
    assert imported - modules <= GATE_STDLIB, sorted(imported - modules)
    assert {m for m in imported if m.startswith("rank_exception_fatal")} == modules


def test_the_gate_s_modules_import_under_python_3_9():
    """The gate's modules do without `from __future__ import annotations` (importing
    __future__ costs the gate 0.5 ms), so Python evaluates their annotations at import:
    `X | None` must be a string there, or Python 3.9, which vLLM 0.8.5-0.11.0 run on,
    fails to load them."""
    import ast

    for module in sorted(GATE_MODULES - {"rank_exception_fatal"}):
        path = os.path.join(BUNDLE, *module.split(".")) + ".py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        if any(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in tree.body):
            continue
        annotations = [node.annotation for node in ast.walk(tree) if isinstance(node, (ast.arg, ast.AnnAssign))]
        annotations += [node.returns for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
        evaluated = [ast.unparse(a) for a in annotations if a and any(isinstance(n, ast.BinOp) for n in ast.walk(a))]
        assert evaluated == [], (module, evaluated)


def package_modules() -> dict[str, str]:
    """{name as the drawing names it: "check", or "extract" of the loop_probe package: its
    path}: every module of the package but the __init__ files, whose names must differ
    across the subpackages for the drawing to tell them apart."""
    package = os.path.join(BUNDLE, "rank_exception_fatal")
    found = []
    for directory, dirs, names in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [(name[:-3], os.path.join(directory, name)) for name in names
                  if name.endswith(".py") and name != "__init__.py"]
    names = [name for name, _ in found]
    assert len(set(names)) == len(names), f"two modules of one name: {sorted(names)}"
    return dict(found)


def test_no_module_loads_another_by_path():
    """Imports only: no importlib.util.spec_from_file_location, runpy or exec of a file."""
    for name, path in sorted(package_modules().items()):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"spec_from_file_location|run_path|exec_module|SourceFileLoader\(", text), name


# --- pure matching: text in, decision out ------------------------------------------------

RELEASES = ["0.8.5", "0.11.0", "0.30.0", "0.33.0"]


@pytest.mark.parametrize("version", RELEASES)
def test_a_release_text_fits_its_diff_on_the_release_side_and_back(version):
    fixes = bundle.read_bundle()
    text = release_bytes(version).decode("utf-8")
    decision = decide.decide(text, fixes)
    assert (decision.state, decision.fix.name) == (NOT_APPLIED_STATE, TABLE_ROWS[version].diff)
    fixed = match.rewrite(match.split_lines(text), decision.fix)
    assert decide.decide(fixed, fixes).state == APPLIED_STATE
    assert match.rewrite(match.split_lines(fixed), decision.fix, revert=True) == text


def test_a_changed_line_in_a_fixed_function_is_drift_named_by_its_line():
    fixes = bundle.read_bundle()
    text = release_bytes("0.30.0").decode("utf-8")
    changed = text.replace('logger.exception("WorkerProc hit an exception.")', 'logger.exception("hit")', 1)
    assert decide.decide(changed, fixes).state == DRIFTED_STATE
    assert adapt.adapt(changed, fixes) is None, "the except branch the fix rests on changed: never placed"
    reason = drift.closest_difference(match.split_lines(changed), fixes)
    assert reason.startswith("closest: v0.30.0.diff hunk ") and "logger.exception(\"hit\")" in reason, reason


def test_a_second_definition_of_the_loop_is_drift():
    fixes = bundle.read_bundle()
    text = release_bytes("0.30.0").decode("utf-8") + "\n\nWorkerProc.worker_busy_loop = lambda self, cancel=None: None\n"
    assert decide.decide(text, fixes).state == DRIFTED_STATE
    assert "rebinds WorkerProc.worker_busy_loop" in drift.drift_reason(text.encode(), text, fixes)


def test_an_argument_added_in_a_fixed_function_is_adapted_by_the_diffs_own_lines():
    fixes = bundle.read_bundle()
    text = release_bytes("0.33.0").decode("utf-8")
    call = "output = func(*args, **kwargs)"
    assert text.count(call) == 1
    build = text.replace(call, "output = func(*args, **dict(kwargs))")
    assert decide.decide(build, fixes).state == DRIFTED_STATE
    adaptation = adapt.adapt(build, fixes)
    assert adaptation is not None and adaptation.fix.name == "v0.33.0.diff" and adaptation.state == NOT_APPLIED_STATE
    placed = match.rewrite(match.split_lines(build), adaptation.fix)
    assert "output = func(*args, **dict(kwargs))" in placed and decide.decide(placed, fixes).state == DRIFTED_STATE
    assert adapt.adapt(placed, fixes).state == APPLIED_STATE


def test_each_module_is_named_in_the_structure_section():
    with open(os.path.join(BUNDLE, "docs", "development.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Structure"): text.index("## Development")]
    assert [m for m in sorted(package_modules()) if f"`{m}`" not in section] == []


def test_a_copy_of_the_bundle_runs_isolated_without_writing_bytecode(make_tree, tmp_path):
    """`python -I -B apply.py` from a copy of the bundle, as from a directory it may not write
    (root may write anywhere, so -B stands for that): the package is found beside apply.py,
    not on the path, it runs from source, and nothing is written into the bundle."""
    import shutil

    copy = tmp_path / "bundle"
    copy.mkdir()
    for name in ("apply.py", "test_rank_exception_fatal.py"):
        shutil.copy(os.path.join(BUNDLE, name), copy)
    for name in ("rank_exception_fatal", "patches", "releases"):
        shutil.copytree(os.path.join(BUNDLE, name), copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    before = sorted(str(p) for p in copy.rglob("*"))
    done = subprocess.run([sys.executable, "-I", "-B", str(copy / "apply.py"), "--check", "--root", make_tree("0.30.0")],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, ""), done.stderr
    assert done.stdout.startswith("not applied (patches/v0.30.0.diff fits)"), done.stdout
    assert sorted(str(p) for p in copy.rglob("*")) == before, "nothing written into the bundle"


def import_edges() -> list[str]:
    """The package's imports of its own modules, as docs/development.md draws them: first
    the loop_probe package's modules as a subgraph, then each import an edge."""
    import ast

    modules = package_modules()
    probe = sorted(name for name, path in modules.items() if os.path.basename(os.path.dirname(path)) == "loop_probe")
    edges = ["  subgraph loop_probe", *(f"    {name}" for name in probe), "  end"]
    for name, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())

        def imported(nodes) -> set[str]:
            # "from .x import", "from ..x import", "from .loop_probe.x import": the module is x;
            # "from . import x", "from .loop_probe import x": the names.
            found = set()
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and node.level >= 1:
                    last = node.module.rsplit(".", 1)[-1] if node.module else None
                    found |= {alias.name for alias in node.names} if last in (None, "loop_probe") else {last}
            return found

        at_import = imported(tree.body)
        for module in sorted(imported(ast.walk(tree)) - {"outcome"}):
            edges.append(f"  {name} {'-->' if module in at_import else '-.->'} {module}")
    return edges


def test_the_drawing_of_the_imports_is_the_code():
    with open(os.path.join(BUNDLE, "docs", "development.md"), encoding="utf-8") as f:
        text = f.read()
    drawing = text[text.index("```mermaid\ngraph LR\n") + len("```mermaid\ngraph LR\n"):]
    assert drawing[: drawing.index("```")].splitlines() == import_edges()
