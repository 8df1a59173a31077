"""How much the deploy gate costs over starting Python: `apply.py --check` vs `python -c "import unidiff"`.

    python3 scripts/bench_check.py [RUNS]

Runs the two commands alternately (so drift in machine load hits both alike) on
a tree made from the real 0.30.0 release file, and prints the median wall time
of each and their ratio. The target is a ratio of at most 1.5.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from fetch_release import TARGET, release_tree

HERE = os.path.dirname(os.path.abspath(__file__))
APPLY = os.path.join(os.path.dirname(HERE), "apply.py")
TARGET_RATIO = 1.5


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
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, os.path.dirname(TARGET)))
        shutil.copyfile(os.path.join(release_tree("0.30.0"), TARGET), os.path.join(root, TARGET))
        gate = [sys.executable, APPLY, "--check", "--root", root]
        baseline = [sys.executable, "-c", "import unidiff"]
        wall_time(gate, 1), wall_time(baseline, 0)  # warm the page cache and bytecode
        gate_times, baseline_times = [], []
        for _ in range(runs):
            gate_times.append(wall_time(gate, 1))
            baseline_times.append(wall_time(baseline, 0))
    gate_median, baseline_median = statistics.median(gate_times), statistics.median(baseline_times)
    ratio = gate_median / baseline_median
    print(
        f"apply.py --check: {gate_median * 1000:.1f} ms, python -c 'import unidiff': "
        f"{baseline_median * 1000:.1f} ms (medians of {runs}); ratio {ratio:.2f} (target <= {TARGET_RATIO})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
