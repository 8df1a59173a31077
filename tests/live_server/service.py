"""The live test's vLLM server as a service a fleet tool restarts: test-only.

    python3 service.py start STATE_DIR PYTHON MODEL PORT   # start, detached; remember how
    python3 service.py restart STATE_DIR                   # stop it, start it again the same way
    python3 service.py stop STATE_DIR
    python3 service.py start-idle STATE_DIR PYTHON TREE         # a stand-in: PYTHON idling, TREE on its PYTHONPATH

What systemd or a container runtime does for a real server, for the fleet test's
playbook: the server runs in a session of its own, detached from whoever started it
(the playbook's ssh session ends at once), logging to STATE_DIR/server.log. Each start
appends the new server's pid to STATE_DIR/starts, which the test reads to tell
whether, and how often, a host's server was restarted. Standard library only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from server import end_group, server_command, server_env, shm_held_by_group  # noqa: E402


def start(state: str, python: str, model: str, port: int) -> int:
    os.makedirs(state, exist_ok=True)
    with open(os.path.join(state, "service.json"), "w") as f:
        json.dump({"python": python, "model": model, "port": port}, f)
    return launch(state, server_command(python, model, state, "tp", port, entry="module"),
                  server_env(state, os.path.join(state, "fault")))


def start_idle(state: str, python: str, tree: str) -> int:
    """A host's stand-in server: a Python that imports from tree, as the server would, and
    idles; the playbook finds its pid, checks and restarts it as a server's."""
    os.makedirs(state, exist_ok=True)
    with open(os.path.join(state, "service.json"), "w") as f:
        json.dump({"python": python, "tree": tree}, f)
    return launch(state, [python, "-c", "import time; time.sleep(3600)"], {**os.environ, "PYTHONPATH": tree})


def launch(state: str, command: list[str], env: dict[str, str]) -> int:
    with open(os.path.join(state, "server.log"), "a") as log:
        process = subprocess.Popen(
            command,
            env=env,
            cwd=state,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    with open(os.path.join(state, "pid"), "w") as f:
        f.write(str(process.pid))
    with open(os.path.join(state, "starts"), "a") as f:
        f.write(f"{process.pid}\n")
    return process.pid


def stop(state: str) -> None:
    try:
        with open(os.path.join(state, "pid")) as f:
            pid = int(f.read())
    except (FileNotFoundError, ValueError):
        return
    held = shm_held_by_group(pid)  # what its killed workers would leave; no other program's
    end_group(pid, term_grace=30)
    for name in held:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
    os.unlink(os.path.join(state, "pid"))


def main(argv: list[str]) -> int:
    command, state = argv[0], argv[1]
    if command == "start":
        start(state, argv[2], argv[3], int(argv[4]))
    elif command == "start-idle":
        start_idle(state, argv[2], argv[3])
    elif command == "restart":
        with open(os.path.join(state, "service.json")) as f:
            how = json.load(f)
        stop(state)
        if "tree" in how:
            start_idle(state, how["python"], how["tree"])
        else:
            start(state, how["python"], how["model"], how["port"])
    elif command == "stop":
        stop(state)
    else:
        print(f"service.py: unknown command {command!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
