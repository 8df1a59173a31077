"""Whether the code a diff changes is the code that runs: read from the module's syntax
tree (a function bound again, a loop that never reaches the fix)."""
from __future__ import annotations

from .bundle import Fix
from .match import enclosing_function


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
    """The methods of WorkerProc that its worker_busy_loop runs (empty without such a
    class or loop); the module's last WorkerProc class is the one that is bound."""
    import ast

    classes = [node for node in module.body if isinstance(node, ast.ClassDef) and node.name == "WorkerProc"]
    return loop_methods(classes[-1]) if classes else set()


def loop_methods(cls) -> set[str]:
    """The methods of the class that its worker_busy_loop runs: itself and every method
    it reaches through self.NAME."""
    import ast

    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached: set[str] = set()
    todo = ["worker_busy_loop"]
    while todo:
        name = todo.pop()
        if name in reached or name not in methods:
            continue
        reached.add(name)
        todo += [n.attr for n in ast.walk(methods[name]) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in methods]
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


def bound_names(item) -> list[str]:
    """The names a statement of a class body binds."""
    import ast

    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [item.name]
    targets = item.targets if isinstance(item, ast.Assign) else (
        [item.target] if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else [])
    return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
