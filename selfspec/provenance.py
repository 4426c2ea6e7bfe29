"""Where a result came from: git commit, package versions, machine."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path


def git_commit(cwd: str | Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=cwd, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint() -> dict:
    """What makes timings of one machine incomparable with another's: CPU, its vector ISA, the packed kernels,
    the pages of their weight copies, cores, threads, torch.

    The ISA (torch's CPU capability: AVX2, AVX512, ...) tells apart CPUs that report the same name
    (a virtual machine's "AMD EPYC" may be a Zen 3 with AVX2 or a Zen 4 with AVX-512), and with the
    libraries it decides which kernels our loop runs on (:func:`~selfspec.kernels.packed.pack_format`:
    bf16 prepacking needs AVX-512; an AVX2 CPU gets fp16 copies, on our kernel or fbgemm's, or fp32 copies).
    " AMX" follows it where the CPU has AMX bf16 tiles, which oneDNN's bf16 products run on (a "Intel(R) Xeon(R)
    Processor" may have them or not).
    """
    import torch

    from selfspec.kernels.hugepages import pages
    from selfspec.kernels.packed import pack_label
    from selfspec.kernels.vnni import cpu_flags

    isa = torch.backends.cpu.get_cpu_capability() + (" AMX" if "amx_bf16" in cpu_flags() else "")
    return {"cpu": cpu_name(), "isa": isa, "kernels": pack_label() or "stock",
            "int4_kernel": _int4_kernel(), "weight_pages": pages(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def _int4_kernel() -> str:
    """Which int4 draft kernel runs here, and whether kept sublayers run fused, whole draft steps included (either
    changes a draft's cost; "fused sublayers" was the form before fused.FusedStep)."""
    from selfspec.draft import fused
    from selfspec.kernels import vnni

    if not vnni.available():
        return f"int4 ({vnni.unavailable_reason()})"
    name = "int4-vnni" if vnni.isa() == "avx512-vnni" else f"int4-vnni on {vnni.isa()}"  # AVX-512: as it always read
    revision = vnni.REVISIONS[vnni.isa()]
    name += f" r{revision}" if revision > 1 else ""
    return f"{name}, fused draft steps" if fused.enabled() else name


def provenance(extra: dict | None = None) -> dict:
    import torch

    versions = {}
    for pkg in ("selfspec", "torch", "transformers", "optuna", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    info = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions,
        "python": platform.python_version(),
        "machine": {
            **{k: v for k, v in machine_fingerprint().items() if k != "torch"},  # torch is under versions
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
    }
    info.update(extra or {})
    return info


def strict_json(value):
    """``value`` with every non-finite float (NaN, ±inf) made ``None``, so any strict JSON reader accepts it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def append_row(path: str | Path, row: dict, *, echo: bool = True) -> dict:
    """Append one measurement as one JSON line to ``path``, with where it came from; returns the row written.

    The row gets ``git_commit``, ``machine`` and ``time`` unless it has them. The line is written by one
    ``write`` on a file opened for appending, then flushed to disk: a crash leaves the earlier lines whole, and
    two writers never interleave inside a line. Non-finite floats are written as ``null``.
    """
    full = {**row}
    full.setdefault("git_commit", git_commit())
    full.setdefault("machine", machine_fingerprint())
    full.setdefault("time", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    append_lines(path, [full])
    if echo:
        print(json.dumps(strict_json(full)), flush=True)
    return full


def append_lines(path: str | Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as strict JSON lines (non-finite floats as null) in one ``write`` on a file
    opened for appending, then flush them to disk: a crash leaves the earlier lines whole, and two writers never
    interleave inside a line."""
    data = "".join(json.dumps(strict_json(r), allow_nan=False) + "\n" for r in rows).encode("utf-8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    start, written = os.fstat(fd).st_size, 0
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole; after a short write (a full disk) the next call raises
            n = os.write(fd, view)
            view, written = view[n:], written + n
        os.fsync(fd)
    except OSError as e:
        # a full disk mid-line: cut what this call wrote (if no other writer appended since), so the file
        # ends with whole lines; the rows are not written and the caller hears why
        try:
            if written and os.fstat(fd).st_size == start + written:
                os.ftruncate(fd, start)
        except OSError:
            pass  # a reader's repair (records.repair_torn_tail) cuts the torn line instead
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)
