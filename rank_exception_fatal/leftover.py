"""The module apply.py created, left in a tree whose vLLM is gone (`pip uninstall vllm` after
a bundle that did not list it in RECORD): found when no executor is, and removed by
--revert with the directories it alone kept, so that `import vllm` fails there again."""
import os
import sys

from .exit_path import HELPER, earlier_helper, helper_bytes
from .outcome import NOT_APPLIED_STATE, OK, REVERTED, TARGET, Report


def left_after_uninstall(root: "str | None", revert: bool, not_found: Report) -> Report:
    """not_found (exit 3) as it is where no such module is; with a note where one is; and
    for --revert, the module removed (0), or left with why (3) if it holds other bytes."""
    left = [path for path in (os.path.join(location, HELPER) for location in locations(root))
            if os.path.isfile(path)]
    if not left:
        return not_found
    path = left[0]
    tree = path[: -len(HELPER) - 1]
    with open(path, "rb") as f:
        data = f.read()
    ours = data == helper_bytes() or earlier_helper(data) is not None
    if not revert or not ours:
        why = ("apply.py --revert removes it" if ours else
               "it holds other bytes than apply.py writes: remove it by hand if no other program wrote it")
        return not_found.replaced(message=f"{not_found.message}; but {path}, the module apply.py creates, is left"
                                          f" where no vLLM executor is, and keeps {os.path.join(tree, 'vllm')}"
                                          f" importable: {why}")
    from .disk import DirectoryLock, remove_file, remove_files
    from .exit_path import bytecode_of

    with DirectoryLock(os.path.join(tree, "vllm")):
        remove_file(path)
        remove_files(bytecode_of(tree, HELPER, sys.pycache_prefix))
    removed = [directory for directory in (os.path.join(tree, "vllm", "entrypoints", "__pycache__"),
                                           os.path.join(tree, "vllm", "entrypoints"), os.path.join(tree, "vllm"))
               if remove_if_empty(directory)]
    return Report(code=OK, state=NOT_APPLIED_STATE, action=REVERTED, message=(
        f"removed {path}, which apply.py created and `pip uninstall` left"
        f"{', with ' + ', '.join(removed) + ', left empty' if removed else ''}"))


def locations(root: "str | None") -> "list[str]":
    """Where Python would look for vllm/: --root, or this Python's path, without a tree
    that still holds an executor (then the module is no leftover)."""
    places = [root] if root else [entry for entry in sys.path if entry and os.path.isabs(entry)]
    return [place for place in places if not os.path.exists(os.path.join(place, TARGET))]


def remove_if_empty(directory: str) -> bool:
    try:
        os.rmdir(directory)
        return True
    except OSError:  # holds something else, or is gone already
        return False
