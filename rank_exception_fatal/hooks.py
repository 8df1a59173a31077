"""Where the exit path's hooks stand (docs/supervisor.md §3): the functions each role's diff
hooks, and whether a file's hooks are in place, read from its syntax tree. The static proof
of a launcher or server file that a diff fits by its own lines but the table does not know
(a build between releases); scripts/make_exit_diffs.py places the hooks by the same table."""
from __future__ import annotations

import ast
from collections.abc import Sequence

MODULE = "_rank_exception_fatal"
IMPORT = f"from vllm.entrypoints import {MODULE}  # rank-exception-fatal: exit 1 if the engine died"
# role -> (the function's path, where the hook stands, its call)
HOOKS = {
    "launcher": ((("terminate_if_errored",), "first", f"{MODULE}.engine_checked(engine)"),
                 (("serve_http", "signal_handler"), "first", f"{MODULE}.stop_requested(app)")),
    "server": ((("run_server",), "first", f"{MODULE}.arm()"),
               (("run_server",), "last", f"{MODULE}.exit_if_engine_died()")),
}


def function(tree: ast.Module, names: Sequence[str]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function at names (a module-level function, then functions defined in its body);
    LookupError unless each name is one function there."""
    scope: list[ast.stmt] = tree.body
    found = None
    for name in names:
        matches = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        if len(matches) != 1:
            raise LookupError(f"{' > '.join(names)}: {len(matches)} functions named {name}")
        found = matches[0]
        scope = found.body
    return found


def own_returns(node: ast.AST) -> list[ast.Return]:
    """The return statements of node's own scope (not of functions or lambdas inside it)."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Return):
            found.append(child)
        elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            found += own_returns(child)
    return found


def hooks_out_of_place(source: str, role: str) -> list[str]:
    """What is not where it belongs in a fixed file: each hook's import and call are the
    first statements of its function (after a docstring), run_server's exit call is its last
    and it has no return before it, and nothing else calls the module. Empty: all in place."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        return [f"does not parse: {e}"]
    problems = []
    expected_import = ast.unparse(ast.parse(IMPORT.partition("  #")[0]))
    for names, where, call in HOOKS[role]:
        try:
            fn = function(tree, names)
        except LookupError as e:
            problems.append(str(e))
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                           and isinstance(s.value.value, str))]
        texts = [ast.unparse(s) for s in body]
        if where == "first" and texts[:2] != [expected_import, call]:
            problems.append(f"{' > '.join(names)} does not start with the hook")
        if where == "last" and (texts[-1:] != [call] or own_returns(fn)):
            problems.append(f"{' > '.join(names)} does not always end with {call}")
    calls = sum(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == MODULE
                for n in ast.walk(tree))
    if calls != len(HOOKS[role]):
        problems.append(f"{calls} calls of {MODULE}, not {len(HOOKS[role])}")
    return problems
