"""Where the hooks of the set's other files stand (docs/supervisor.md §3, docs/silent.md):
the functions each role's diff hooks, and whether a file's hooks are in place, read from
its syntax tree. The static proof of a launcher, server or queue file that a diff fits by
its own lines but the table does not know (a build between releases);
scripts/make_exit_diffs.py places the hooks by the same table."""
from __future__ import annotations

import ast
from collections.abc import Sequence

MODULE = "_rank_exception_fatal"
# What each role's hooks are for, as their import's comment says it.
WHY = {"launcher": "exit 1 if the engine died", "server": "exit 1 if the engine died",
       "queue": "a silent node drops its connection"}
AFTER = "after "
# role -> (the function's path, where the hook stands, its call). Where: first in the
# function (after a docstring), last, or AFTER a statement (its text as ast.unparse
# gives it), the one of the function that reads so, in whatever block it stands.
HOOKS = {
    "launcher": ((("terminate_if_errored",), "first", f"{MODULE}.engine_checked(engine)"),
                 (("serve_http", "signal_handler"), "first", f"{MODULE}.stop_requested(app)")),
    "server": ((("run_server",), "first", f"{MODULE}.arm()"),
               (("run_server",), "last", f"{MODULE}.exit_if_engine_died()")),
    # The heartbeat goes on the sockets between nodes before they bind or connect (libzmq
    # takes it only for connections made after): the remote XPUB the writer makes, the
    # remote SUB a reader on another node makes.
    "queue": ((("MessageQueue", "__init__"), f"{AFTER}self.remote_socket.setsockopt(XPUB_VERBOSE, True)",
               f"{MODULE}.heartbeat(self.remote_socket)"),
              (("MessageQueue", "create_from_handle"), f"{AFTER}self.remote_socket.setsockopt_string(SUBSCRIBE, '')",
               f"{MODULE}.heartbeat(self.remote_socket)")),
}


def import_line(role: str) -> str:
    return f"from vllm.entrypoints import {MODULE}  # rank-exception-fatal: {WHY[role]}"


def function(tree: ast.Module, names: Sequence[str]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function at names (a module-level function or class, then functions defined in
    its body); LookupError unless each name is one function (or, but the last, one class) there."""
    scope: list[ast.stmt] = tree.body
    found = None
    for depth, name in enumerate(names):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) + ((ast.ClassDef,) if depth < len(names) - 1 else ())
        matches = [n for n in scope if isinstance(n, kinds) and n.name == name]
        if len(matches) != 1:
            raise LookupError(f"{' > '.join(names)}: {len(matches)} functions named {name}")
        found = matches[0]
        scope = found.body
    return found


def statement_after(fn: ast.AST, where: str) -> "tuple[list[ast.stmt], int]":
    """(the block, the index in it) of the statement a hook AFTER it names, in fn's own
    scope; LookupError unless exactly one statement reads so."""
    anchor = where[len(AFTER):]
    found = []

    def search(node: ast.AST) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for index, statement in enumerate(block):
                if isinstance(statement, ast.stmt) and ast.unparse(statement) == anchor:
                    found.append((block, index))
                if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    search(statement)

    search(fn)
    if len(found) != 1:
        raise LookupError(f"{len(found)} statements read {anchor}")
    return found[0]


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
    first statements of its function (after a docstring), or the two after the statement
    it follows; run_server's exit call is its last and it has no return before it; and
    nothing else calls the module. Empty: all in place."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        return [f"does not parse: {e}"]
    problems = []
    expected_import = ast.unparse(ast.parse(import_line(role).partition("  #")[0]))
    for names, where, call in HOOKS[role]:
        try:
            fn = function(tree, names)
            if where.startswith(AFTER):
                block, index = statement_after(fn, where)
                if [ast.unparse(s) for s in block[index + 1:index + 3]] != [expected_import, call]:
                    problems.append(f"{' > '.join(names)} has no hook {where}")
                continue
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
