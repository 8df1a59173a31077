"""Test-only: vLLM's CPU platform for engine_steps.py's stand-in workers, which run no kernel.

vLLM 0.34.0's CPU platform refuses an x86 machine without triton-cpu (not on PyPI);
the stand-in workers need no Triton, so its check reads Triton as there.
"""
from vllm.platforms.cpu import CpuPlatform


class StandInCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        import vllm.triton_utils  # not at import: it reads the platform being resolved

        has_triton = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            super().check_and_update_config(vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = has_triton
