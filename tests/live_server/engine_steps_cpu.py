"""Test-only vLLM platform plugin for engine_steps.py: the CPU platform for any vLLM build.

engine_steps_cpu-0.0.dist-info beside this file declares it; vLLM sees it only where
this folder is on sys.path, as in engine_steps.py, so that a CUDA build of vLLM runs
the engine here. The stand-in workers call none of the platform's kernels. A module of
its own: vLLM imports it while it picks its platform, before vLLM can be imported.
"""


def platform() -> str:
    return "engine_steps_cpu_platform.StandInCpuPlatform"
