"""vLLM's real engine stepping on two stand-in workers: EngineCore, its scheduler,
MultiprocExecutor, FutureWrapper and two WorkerProc loops, as a server runs them.

Test-only. Run with the Python of a vLLM install (it imports vLLM):

    python engine_steps.py MODEL_DIR WORKDIR '{"ROW": {"async": true, "kv": false, "fault": {...}}, ...}'

For each row, EngineCore is built by vLLM itself (EngineArgs -> VllmConfig ->
EngineCore) with the mp executor at TP=2; only the model worker is a stand-in
(parallel_config.worker_cls = engine_steps.StandInWorker), so that a step can fail on
the rank and at the step a test asks, and with async scheduling, which vLLM's CPU
runner cannot run:

- execute_model keeps the step's batch and returns None, as vLLM's V1 runner does;
  sample_tokens answers with one token a request. A step whose execute_model never
  ran is answered by vLLM's own GPUModelRunner.sample_tokens, whose branch for it
  returns an empty output (with only the KV connector's part).
- Before it "runs" a step, each rank takes part in a stand-in collective: it counts
  its steps in the row's directory and waits until every rank has counted as many, as
  a TP all-reduce waits for every rank. A rank that fails before it leaves the others
  waiting, until its next step pairs with their old one.
- With "kv", vLLM's ExampleConnector is configured (its scheduler side is vLLM's),
  so every rank replies to each step; the workers report an empty connector output.

fault: {"rank": R, "step": N} fails rank R's N-th step (1-based) in execute_model,
before its collective. "finish": true also aborts the requests in the engine once the
fault has fired, before their output is read.

A vLLM build for an accelerator runs on vLLM's CPU platform here, through the
test-only platform plugin engine_steps_cpu beside this file.

It prints one JSON line a row: {"row": name, "steps": engine steps taken, "tokens":
{request id: tokens}, "error": "Type: message" if a step raised, "after_fault":
seconds from the fault to the end of the row}.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = {f"req-{i}": [11 + i, 12, 13, 14] for i in range(2)}
MAX_TOKENS = 6
COLLECTIVE_WAIT_SECONDS = 600  # a stuck rank waits this long at most


def stand_in_runner_sample_tokens(kv_connector_output):
    """vLLM's own GPUModelRunner.sample_tokens, on a runner with no step state:
    what the real runner answers for a step whose execute_model never ran (the V1
    runner's, or in 0.34.0, which has no other, Model Runner V2's)."""
    import inspect
    import types

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ModuleNotFoundError:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = types.SimpleNamespace(
        execute_model_state=None,
        kv_connector_output=kv_connector_output,
        use_async_scheduling=False,  # the PP receive it guards needs distributed groups
    )
    # The method's own body: 0.34.0 wraps it in a step of the expert load balancer.
    return inspect.unwrap(GPUModelRunner.sample_tokens)(runner, None)


from vllm.v1.worker.worker_base import WorkerBase  # noqa: E402  (the workers import this module)


class StandInWorker(WorkerBase):
    def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=False, **kwargs):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.workdir = os.environ["ENGINE_STEPS_DIR"]
        self.fault = json.loads(os.environ.get("ENGINE_STEPS_FAULT") or "{}")
        self.kv = vllm_config.kv_transfer_config is not None
        self.steps = 0
        self.batch = None

    # --- start-up: what EngineCore asks of a worker, without a model or a device ---

    def init_device(self):
        pass

    def load_model(self, *args, **kwargs):
        pass

    def determine_available_memory(self):
        return 64 << 20

    def get_kv_cache_spec(self):
        import torch

        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
        return {"model.layers.0.self_attn.attn": spec}

    def initialize_from_config(self, kv_cache_config):
        pass

    def initialize_cache(self, num_gpu_blocks, num_cpu_blocks):
        pass

    def compile_or_warm_up_model(self):
        try:
            from vllm.v1.worker.worker_base import CompilationTimes
        except ImportError:  # releases that take a float
            return 0.0
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def check_health(self):
        pass

    def shutdown(self):
        pass

    def get_kv_connector_handshake_metadata(self):
        return None

    # --- the step ---------------------------------------------------------------------

    def execute_model(self, scheduler_output):
        if scheduler_output.total_num_scheduled_tokens == 0:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            return EMPTY_MODEL_RUNNER_OUTPUT  # as vLLM's runner answers an empty step
        self.steps += 1
        if self.fault.get("rank") == self.rank and self.fault.get("step") == self.steps:
            with open(os.path.join(self.workdir, "fault"), "w") as f:
                f.write(f"{time.time():.6f}\n")
            raise RuntimeError(f"stand-in execute_model failed on rank {self.rank} at step {self.steps}")
        self.collective()
        self.batch = list(scheduler_output.num_scheduled_tokens)
        return None

    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        kv_output = KVConnectorOutput() if self.kv else None
        if self.batch is None:
            return stand_in_runner_sample_tokens(kv_output)
        batch, self.batch = self.batch, None
        # 0.34.0's output lost req_id_to_index (the order of req_ids says it).
        index = {"req_id_to_index": {req_id: i for i, req_id in enumerate(batch)}}
        return ModelRunnerOutput(
            req_ids=batch,
            sampled_token_ids=[[100 + self.steps] for _ in batch],
            kv_connector_output=kv_output,
            **(index if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {}),
        )

    def collective(self):
        """Count this rank's step and wait until every rank has counted as many."""
        mine = os.path.join(self.workdir, f"collective.{self.rank}")
        with open(mine, "a") as f:
            f.write("x")
        count = os.path.getsize(mine)
        world = self.vllm_config.parallel_config.world_size
        deadline = time.monotonic() + COLLECTIVE_WAIT_SECONDS
        while time.monotonic() < deadline:
            counts = []
            for rank in range(world):
                try:
                    counts.append(os.path.getsize(os.path.join(self.workdir, f"collective.{rank}")))
                except FileNotFoundError:
                    counts.append(0)
            if min(counts) >= count:
                return
            time.sleep(0.001)


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main(model: str, workdir: str, scenarios: dict[str, dict]) -> int:
    # The workers import engine_steps.StandInWorker; vLLM finds engine_steps_cpu here.
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)

    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    for name, scenario in scenarios.items():  # one engine each; vLLM is imported once
        directory = os.path.join(workdir, name)
        os.makedirs(directory)
        os.environ["ENGINE_STEPS_DIR"] = directory  # read by the workers it starts
        os.environ["ENGINE_STEPS_FAULT"] = json.dumps(scenario.get("fault") or {})
        kv = None
        if scenario.get("kv"):
            kv = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": os.path.join(directory, "kv")},
            }
        args = EngineArgs(
            model=model,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            worker_cls="engine_steps.StandInWorker",
            async_scheduling=bool(scenario.get("async")),
            kv_transfer_config=kv,
            max_model_len=256,
            enforce_eager=True,
            dtype="float32",
        )
        config = args.create_engine_config()
        # vLLM's CPU platform turns async scheduling off, for its runner's sake; the
        # stand-in workers need none of that runner, and the engine's path is the point.
        config.scheduler_config.async_scheduling = bool(scenario.get("async"))
        engine = EngineCore(config, MultiprocExecutor, log_stats=False)
        try:
            emit(row=name, **run(engine, directory, scenario, EngineCoreRequest, SamplingParams))
        finally:
            # The executor's shutdown ends the workers. EngineCore.shutdown() would then
            # tear down this process's zmq context, which can block for good on a socket
            # to a killed worker; the process ends by os._exit once every row is done.
            engine.model_executor.shutdown()
    return 0


def run(engine, directory: str, scenario: dict, EngineCoreRequest, SamplingParams) -> dict:
    """Step the engine until its requests finish or a step raises."""
    for request_id, prompt in PROMPTS.items():
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        engine.add_request(*engine.preprocess_add_request(request))
    result: dict = {"batch_queue": engine.batch_queue_size, "tokens": {}, "steps": 0}
    fault_file = os.path.join(directory, "fault")
    fault_step = (scenario.get("fault") or {}).get("step")
    sent = count_model_steps_sent(engine.model_executor)
    try:
        while (engine.scheduler.has_requests() or engine.batch_queue) and result["steps"] < 200:
            result["steps"] += 1
            if scenario.get("finish") and fault_step and sent["steps"] >= fault_step:
                # The failing step is on its way to the workers; abort only once it has
                # failed there, and before the engine reads it, so the row does not race
                # the worker (it did, on a busy CI machine).
                wait_for(fault_file)
                engine.abort_requests(list(PROMPTS))
            outputs, _ = engine.step_fn()
            for engine_outputs in (outputs or {}).values():
                for output in engine_outputs.outputs:
                    result["tokens"].setdefault(output.request_id, []).extend(output.new_token_ids)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if os.path.exists(fault_file):
        with open(fault_file) as f:
            result["after_fault"] = round(time.time() - float(f.read()), 3)
    return result


def count_model_steps_sent(executor) -> dict:
    """Count the non-empty execute_model calls the engine sends, passing each on."""
    sent = {"steps": 0}
    execute_model = executor.execute_model

    def counted(scheduler_output, *args, **kwargs):
        if scheduler_output.total_num_scheduled_tokens:
            sent["steps"] += 1
        return execute_model(scheduler_output, *args, **kwargs)

    executor.execute_model = counted
    return sent


def wait_for(path: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    sys.stdout.flush()
    # Threads vLLM leaves behind after a failed engine's shutdown can keep the
    # interpreter from exiting; every row is done and reported.
    os._exit(code)
