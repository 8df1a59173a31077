"""The loop probe, asked in a child: whether the bundle's loop test passes on a new text
(an adapted change is written only once it does), and what a file's loop does with a
failure (for a file that no diff fits)."""
from __future__ import annotations

import os

from .bundle import LOOP_TEST
from .spawn import child_command
from .outcome import TARGET

# What behaviour() found: the loop needs nothing, in either of these ways.
EXITS, REPLIES = "exits", "replies"

# The executor's reads of a call's result that the loop test drives, as EngineCoreProc
# calls them: FutureWrapper's result() (0.11.1 on; through wait_for_response(), from
# 0.20.0 _wait_for_response()) and poll() / wait_briefly() (0.34.0 on). A file whose
# future has any other method reads in a way no proof here has run.
DRIVEN_READS = frozenset({"__init__", "result", "wait_for_response", "_wait_for_response", "poll", "wait_briefly"})


def undriven_reads(text: str | None) -> list[str]:
    """The methods of the file's FutureWrapper that the loop test does not drive."""
    import ast

    try:
        module = ast.parse(text or "")
    except (SyntaxError, ValueError):
        return []
    return sorted(
        method.name
        for node in module.body if isinstance(node, ast.ClassDef) and node.name == "FutureWrapper"
        for method in node.body
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.name not in DRIVEN_READS
    )


def undriven_words(undriven: list[str]) -> str:
    methods = ", ".join(f"FutureWrapper.{name}()" for name in undriven)
    return (f"its executor reads a call's result through {methods}, which the bundle's loop test does not drive:"
            " this vLLM needs a diff of its own")


def prove(new: bytes, real: str) -> str | None:
    """None if the bundle's loop test passes on the new text, run in a child as an
    operator runs it; else why not."""
    import shutil
    import tempfile

    if not os.path.isfile(LOOP_TEST):
        return f"{LOOP_TEST} is missing: an adapted change is proven with it; copy the whole bundle"
    with tempfile.TemporaryDirectory(prefix="rank-exception-fatal-proof-") as tree:
        os.makedirs(os.path.join(tree, os.path.dirname(TARGET)))
        with open(os.path.join(tree, TARGET), "wb") as f:
            f.write(new)
        vllm = real[: -len(TARGET)] + "vllm"
        for config in ("config/parallel.py", "config.py"):  # whether it has fault tolerance
            if os.path.isfile(os.path.join(vllm, config)):
                os.makedirs(os.path.dirname(os.path.join(tree, "vllm", config)), exist_ok=True)
                shutil.copyfile(os.path.join(vllm, config), os.path.join(tree, "vllm", config))
        env = {k: v for k, v in os.environ.items() if k != "RANK_EXCEPTION_FATAL_FAULT_TOLERANCE"}
        verdict, problem = ask(child_command("prove"), {**env, "GAUDI_FIXES_ROOT": tree}, timeout=600)
    if problem:
        return f"the loop test could not run: {problem}"
    if verdict.get("passed"):
        return None
    return "the loop test fails on the result: " + (", ".join(verdict.get("failed") or []) or "no test ran")


def unproven(data: bytes, path: str, decision, adaptation) -> str | None:
    """For a file whose fix stands adapted (written by apply.py, which proved it then, or
    placed by hand): None if the loop test passes on it now, else why it does not."""
    from .adapt import adapted_words

    failure = prove(data, os.path.realpath(path))
    if failure is None:
        return None
    return f"patches/{decision.fix.name} stands, {adapted_words(adaptation)}; but {failure}"


def loop_behaviour(path: str) -> str | None:
    """EXITS, REPLIES, or another word of loop_cases.behaviour() for the file's loop;
    None if the probe could not run."""
    verdict, problem = ask(child_command("behaviour", os.path.realpath(path)), None, timeout=300)
    return None if problem else verdict.get("behaviour")


def ask(command: list[str], env: dict | None, timeout: float) -> tuple[dict, str | None]:
    """(the child's JSON answer, None), or ({}, why there is none)."""
    import json
    import subprocess

    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, str(e)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return {}, f"exit status {done.returncode}: {done.stderr.strip()[-200:]}"
