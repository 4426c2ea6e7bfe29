"""The CPU kernels every full-model forward and every draft step runs on, chosen by the CPU found at run time:
oneDNN-prepacked bf16 weights (``packed``), our fp16 panel kernel for CPUs without bf16 packing (``fp16``), the
int4 draft kernel with its VNNI and AVX2 builds (``vnni``), and the C++ sources under ``csrc/``, compiled on first
use into ``$SELFSPEC_CACHE/kernels``. Nothing here imports the engine, the draft or anything above them."""


def reset_kernels() -> None:
    """Forget which kernels loaded, so the next use chooses again by the environment and the CPU flags it finds."""
    from selfspec.kernels import fp16, vnni

    vnni._KERNEL.reset()
    fp16._KERNEL.reset()
