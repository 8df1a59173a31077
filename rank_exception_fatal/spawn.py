"""How the bundle starts a child process of its own: this Python, isolated (or with its own
flags, for --verify's harness), this package imported from the bundle, children.main."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

BUNDLE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The bundle goes first on sys.path, in the place of the working directory that -c puts
# there (and that -I and -P leave out): as when a script of the bundle is run.
CHILD = """\
import sys
bundle = sys.argv.pop(1)
if sys.path and sys.path[0] == "":
    sys.path[0] = bundle
else:
    sys.path.insert(0, bundle)
from rank_exception_fatal.children import main
sys.exit(main(sys.argv[1:]))
"""


def child_command(*args: str, flags: Sequence[str] = ("-I",)) -> list[str]:
    """The command that runs main(args) in a child of this Python: case PATH CASE_JSON,
    behaviour PATH, prove (the loop test on $GAUDI_FIXES_ROOT), or harness PATH ROOT
    (--verify's, which imports vLLM, with this interpreter's own flags)."""
    return [sys.executable, *flags, "-c", CHILD, BUNDLE, *args]
