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
# future binds any other name reads in a way no proof here has run.
DRIVEN_READS = frozenset({"__init__", "result", "wait_for_response", "_wait_for_response", "poll", "wait_briefly"})
# MultiprocExecutor's methods that touch the reply queues or the future, in every release
# and in the fix: another one is a read the loop test has not run.
KNOWN_EXECUTOR_READS = frozenset({"_init_executor", "collective_rpc", "get_response_mqs", "shutdown",
                                  "start_worker_monitor", "_watch_remote_workers"})


def undriven_reads(text: str | None) -> list[str]:
    """The reads of a call's result the loop test does not drive: names the file's
    FutureWrapper (or a class derived from it) binds beyond DRIVEN_READS, in its body or
    from outside it, and MultiprocExecutor methods beyond KNOWN_EXECUTOR_READS that read
    the reply queues."""
    import ast

    from .bindings import bound_names

    try:
        module = ast.parse(text or "")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    futures = {"FutureWrapper"} | {
        node.name for node in module.body if isinstance(node, ast.ClassDef)
        and any(isinstance(base, ast.Name) and base.id == "FutureWrapper" for base in node.bases)
    }
    found = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name in futures:
            found.update(f"{node.name}.{name}" for item in node.body for name in bound_names(item)
                         if name not in DRIVEN_READS)
        elif isinstance(node, ast.ClassDef) and node.name == "MultiprocExecutor":
            found.update(f"MultiprocExecutor.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and item.name not in KNOWN_EXECUTOR_READS and reads_replies(item))
        else:
            for sub in ast.walk(node):  # FutureWrapper.x = ..., setattr(FutureWrapper, "x", ...)
                targets = sub.targets if isinstance(sub, ast.Assign) else (
                    [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else [])
                found.update(f"{t.value.id}.{t.attr}" for t in targets if isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id in futures)
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "setattr"
                        and sub.args and isinstance(sub.args[0], ast.Name) and sub.args[0].id in futures):
                    found.add(f"{sub.args[0].id}.(setattr)")
    return sorted(found)


def reads_replies(function) -> bool:
    import ast

    return any((isinstance(n, ast.Attribute) and n.attr in ("response_mqs", "dequeue", "readable"))
               or (isinstance(n, ast.Name) and n.id == "FutureWrapper") for n in ast.walk(function))


def undriven_words(undriven: list[str]) -> str:
    reads = ", ".join(f"{name}()" for name in undriven)
    return (f"its executor reads a call's result through {reads}, which the bundle's loop test does not drive:"
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
    failed = dict.fromkeys(verdict.get("failed") or [])  # a test's subtests name it again
    return "the loop test fails on the result: " + (", ".join(failed) or "no test ran")


def unproven(data: bytes, path: str, decision, adaptation) -> str | None:
    """For a file whose fix stands and that the release table does not know (a build, or a
    release newer than the table; written by apply.py, which proved it then, or by hand):
    None if the loop test passes on it now, else why it does not."""
    from .adapt import adapted_words

    failure = prove(data, os.path.realpath(path))
    if failure is None:
        return None
    how = f", {adapted_words(adaptation)}" if adaptation is not None else ""
    return f"patches/{decision.fix.name} stands{how}; but {failure}"


def known_file(data: bytes) -> bool:
    """Whether the file is a release's or the one its diff makes (releases/releases.tsv),
    byte for byte: CI proves each of those on its bytes, so a fix there needs no proof."""
    from .bundle import read_table_text
    from .seal import sha256_hex
    from .table import read_releases

    digest = sha256_hex(data)
    return any(digest in (release.sha256, release.fixed_sha256) for release in read_releases(read_table_text()).values())


def loop_behaviour(path: str) -> str | None:
    """EXITS, REPLIES, or another word of loop_probe.cases.behaviour() for the file's loop;
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
