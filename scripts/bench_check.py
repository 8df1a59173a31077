"""What the deploy gate costs: `apply.py --check` on a known file against a bare Python start
(`python -c pass`) and against `python -c "import unidiff"`, measured side by side.

    python3 scripts/bench_check.py [RUNS]

Runs the four commands in turn, RUNS times, in a new order each time (so that drift in
machine load, and one command's effect on the next, hit all alike): the gate on a tree
holding the real 0.30.0 release's files, the executor, launcher and server file (exit 1),
and on one holding the files apply.py makes of them (exit 0, as on a fixed node), with the bundle's bytecode cached first (compileall: as on
a node after the first run). Prints the median wall
time of each and the gate's ratios to the other two. The target: at most 1.3 times a
bare Python start.
"""
from __future__ import annotations

import compileall
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from fetch_release import release_tree

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLE = os.path.dirname(HERE)
APPLY = os.path.join(BUNDLE, "apply.py")
TARGET_RATIO = 1.3


def wall_time(command: list[str], expected_code: int) -> float:
    start = time.perf_counter()
    code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    elapsed = time.perf_counter() - start
    if code != expected_code:
        raise SystemExit(f"bench_check.py: {command} exited {code}, expected {expected_code}")
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    runs = int(args[0]) if args else 41
    compileall.compile_dir(os.path.join(BUNDLE, "rank_exception_fatal"), quiet=1)
    with tempfile.TemporaryDirectory() as release, tempfile.TemporaryDirectory() as fixed:
        for root in (release, fixed):
            shutil.copytree(os.path.join(release_tree("0.30.0"), "vllm"), os.path.join(root, "vllm"))
        subprocess.run([sys.executable, APPLY, "--root", fixed], stdout=subprocess.DEVNULL, check=True)
        commands = {
            "apply.py --check (release)": ([sys.executable, APPLY, "--check", "--root", release], 1),
            "apply.py --check (fixed)": ([sys.executable, APPLY, "--check", "--root", fixed], 0),
            "python -c pass": ([sys.executable, "-c", "pass"], 0),
            "python -c 'import unidiff'": ([sys.executable, "-c", "import unidiff"], 0),
        }
        for command, code in commands.values():
            wall_time(command, code)  # warm the page cache
        times: dict[str, list[float]] = {name: [] for name in commands}
        order = list(commands)
        for _ in range(runs):
            random.shuffle(order)  # none always runs just after another's cache damage
            for name in order:
                times[name].append(wall_time(*commands[name]))
    *gates, bare, unidiff = (statistics.median(times[name]) for name in commands)
    for name, gate in zip(commands, gates):
        print(f"{name}: {gate * 1000:.1f} ms; ratio to a bare start {gate / bare:.2f} (target <= {TARGET_RATIO}),"
              f" to importing unidiff {gate / unidiff:.2f}")
    print(f"python -c pass: {bare * 1000:.1f} ms, python -c 'import unidiff': {unidiff * 1000:.1f} ms (medians of {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
