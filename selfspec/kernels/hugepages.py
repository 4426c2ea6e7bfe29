"""Huge pages for the weight copies our kernels stream (Linux): :func:`advise`.

A one-row product reads each of its weights once per step, so every 4 KiB page of them costs a TLB miss, and in a
virtual machine a miss walks two page tables (the guest's and the host's). Copies on 2 MiB pages take 512 times fewer.
Where the kernel allows it (Linux 6.1 or later for ``MADV_COLLAPSE``), :func:`advise` moves the 2 MiB-aligned interior
of a tensor's storage onto huge pages in place: the same memory, address and values, whatever the system's
transparent-huge-page setting (``madvise`` on most distributions, which leaves torch's allocations on 4 KiB pages).
On a 2-core Xeon with AMX (a virtual machine) the 1.5B's int4 draft steps then took 0.73-0.85 of their time, its plain
steps 0.95-0.97, and its 7-row verifies 0.98-1.04 (two runs of ``python scripts/hugepages.py``, docs/kernels.md).

The int4 copies (each once, where it ends up: a linear's own from :func:`selfspec.kernels.vnni.pack`, or its
siblings' stacked copy, :func:`selfspec.draft.lowbit.wrap_linears`) and the fp16 panels
(:func:`selfspec.kernels.fp16.pack`) are advised as they are made: our AR baseline and every draft get the same
treatment. ``SELFSPEC_HUGEPAGES=0`` leaves them on the allocator's pages. Elsewhere (another OS, an older kernel, a
refusal) nothing changes and nothing fails.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

ENV = "SELFSPEC_HUGEPAGES"  # 0: leave the weight copies on the allocator's pages
HUGE = 2 << 20  # bytes in a huge page (x86-64)
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <linux/mman.h>


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where it cannot be called (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def enabled() -> bool:
    """Whether :func:`advise` tries: on Linux, unless ``SELFSPEC_HUGEPAGES=0``."""
    return os.environ.get(ENV, "1") != "0" and _madvise() is not None


def advise(t: torch.Tensor) -> int:
    """Put the whole 2 MiB pages inside ``t``'s storage (a CPU tensor) on huge pages, in place; the bytes that now are,
    0 where none (a storage under 4 MiB may hold no whole aligned page; the kernel may refuse). Pages outside the
    storage are never touched, so its neighbours in memory keep theirs."""
    if not enabled() or t.device.type != "cpu":
        return 0
    storage = t.untyped_storage()
    start = storage.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + storage.nbytes()) // HUGE * HUGE
    if hi <= lo:
        return 0
    madvise = _madvise()
    if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:  # pages touched from now on come huge; the next call moves the rest
        return 0
    return hi - lo if madvise(lo, hi - lo, MADV_COLLAPSE) == 0 else 0


def pages() -> str:
    """The pages weight copies get here: "2 MiB" where :func:`advise` moves a probe's interior onto huge pages,
    "4 KiB" where it does not (switched off, another OS, a kernel without ``MADV_COLLAPSE``). The machine fingerprint
    records it: the copies' pages change what a draft step costs, so cost models of the two do not mix."""
    return _probe() if enabled() else "4 KiB"


@functools.cache
def _probe() -> str:
    probe = torch.zeros(3 * HUGE, dtype=torch.uint8)  # holds at least one whole aligned huge page, touched
    return "2 MiB" if advise(probe) else "4 KiB"
