"""The CPU kernels every full-model forward and every draft step runs on, chosen by the CPU found at run time:
oneDNN-prepacked bf16 weights (``packed``), our fp16 panel kernel for CPUs without bf16 packing (``fp16``), our AMX
tile kernel for CPUs with AMX (``amx``), the int4 draft kernel with its VNNI and AVX2 builds (``vnni``, whose library
also holds the row-invariant decode attention for bf16 rows), and the C++ sources under ``csrc/``, compiled on first
use into ``$SELFSPEC_CACHE/kernels``. Nothing here imports the engine, the draft or anything above them."""


def reset_kernels() -> None:
    """Forget which kernels loaded and what was said about them, so the next use chooses again by the environment and
    the CPU flags it finds, and says again which kernels run where bf16 weights cannot be packed."""
    from selfspec.kernels import amx, fp16, packed, vnni

    vnni._KERNEL.reset()
    fp16._KERNEL.reset()
    amx._KERNEL.reset()
    packed._say_unpacked.cache_clear()
