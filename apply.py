#!/usr/bin/env python3
"""Apply, check or revert the rank-exception-fatal fix in vLLM's multiproc executor.

A thin entry: the rank_exception_fatal package beside this file does the work
(python3 apply.py --help lists the options and exit codes). The package is taken from
this file's own directory, first on sys.path, also under `python3 -I apply.py`."""
import os
import sys

if __name__ == "__main__":
    import gc

    # A run is short and leaves no garbage cycles worth finding: the collector's passes
    # over the imports cost the deploy gate a few percent of its time.
    gc.disable()

HERE = os.path.dirname(os.path.realpath(__file__))  # the bundle is beside the file, not a link to it
BAD_BUNDLE = 5


def missing_package(why: str) -> int:
    message = (f"{os.path.join(HERE, 'rank_exception_fatal')} {why}: copy the whole bundle (apply.py with"
               " rank_exception_fatal/, patches/, releases/ and test_rank_exception_fatal.py)")
    if "--json" in sys.argv[1:]:  # fleet tooling reads one object whatever went wrong
        import json

        print(json.dumps({"state": "error", "action": "none", "path": None, "distribution": None, "version": None,
                          "diff": None, "adapted": False, "sha256_before": None, "sha256_after": None,
                          "files": None, "message": message, "exit_code": BAD_BUNDLE}))
    else:
        print(f"apply.py: {message}", file=sys.stderr)
    return BAD_BUNDLE


sys.path.insert(0, HERE)
# Never another bundle's package, found further on the path.
if not os.path.isfile(os.path.join(HERE, "rank_exception_fatal", "__init__.py")):
    raise SystemExit(missing_package("is missing"))
try:
    from rank_exception_fatal import damaged_file, of_the_bundle

    damaged = damaged_file()  # any module a mode imports later: refused now, not halfway with a wrong answer
    if damaged is None:
        from rank_exception_fatal.cli import leave, main
except Exception as e:  # a damaged copy, or a Python the package cannot run on: one line, never a traceback
    raise SystemExit(missing_package(f"cannot be loaded ({type(e).__name__}: {e})")) from None
if damaged:
    raise SystemExit(missing_package(f"is not whole ({damaged})"))

if __name__ == "__main__":
    try:
        code = main()
    except (ImportError, SyntaxError) as e:  # a module of the bundle damaged: one line, never a traceback
        if not of_the_bundle(e):
            raise
        code = missing_package(f"cannot be loaded ({type(e).__name__}: {e})")
    if not isinstance(code, int):  # never a status the bundle did not decide (a None would read as 0)
        code = missing_package(f"cannot be run (it answered {code!r}, not an exit code)")
    if globals() is vars(sys.modules["__main__"]):  # run by Python itself, not by a profiler or a harness
        leave(sys.argv[1:], code)  # the gate ends here, without the interpreter's teardown
    raise SystemExit(code)
