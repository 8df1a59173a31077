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
