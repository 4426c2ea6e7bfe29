"""Huge pages for weight copies: in place, values kept, whole pages inside the storage only, and off on request."""

from __future__ import annotations

import pytest
import torch

from selfspec.kernels import hugepages, vnni


def huge_in(lo: int, hi: int) -> int:
    """Bytes on anonymous huge pages in the mappings of this process that overlap [lo, hi)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = start < hi and end > lo
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_advise_keeps_the_tensor_and_puts_its_whole_pages_on_huge_pages(monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    if not hugepages.enabled():
        pytest.skip("madvise cannot be called here")
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: at least five whole aligned 2 MiB pages inside
    before, ptr = t.clone(), t.data_ptr()
    n = hugepages.advise(t)
    assert t.data_ptr() == ptr and torch.equal(t, before)
    assert n % hugepages.HUGE == 0 and n <= t.numel() * t.element_size()
    if not n:
        pytest.skip("this kernel keeps these pages at 4 KiB (no MADV_COLLAPSE, or it refused)")
    assert n >= 5 * hugepages.HUGE
    lo = -(-ptr // hugepages.HUGE) * hugepages.HUGE
    assert huge_in(lo, lo + n) >= n


def test_advise_leaves_small_storages_and_the_switched_off_case_alone(monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    assert hugepages.advise(torch.zeros(1 << 18)) == 0  # 1 MiB: no whole aligned huge page can lie inside
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled()
    assert hugepages.advise(torch.zeros(3 << 20)) == 0


def test_int4_packing_gives_the_same_bytes_either_way(monkeypatch):
    q = torch.randint(0, 16, (512, 4096), generator=torch.Generator().manual_seed(0))
    sz = torch.randn(512, 4096 // 128, 2)
    monkeypatch.setenv(hugepages.ENV, "0")
    plain = vnni.pack(q, sz)
    monkeypatch.setenv(hugepages.ENV, "1")
    huge = vnni.pack(q, sz)
    assert all(torch.equal(a, b) for a, b in zip(plain, huge))
    assert torch.equal(vnni.unpack(huge[0]), q)


def test_the_machine_fingerprint_names_the_pages_weight_copies_get(monkeypatch):
    from selfspec.provenance import machine_fingerprint

    monkeypatch.delenv(hugepages.ENV, raising=False)
    got = hugepages.advise(torch.zeros(3 * hugepages.HUGE, dtype=torch.uint8))
    assert machine_fingerprint()["weight_pages"] == ("2 MiB" if got else "4 KiB")
    monkeypatch.setenv(hugepages.ENV, "0")  # switched off: a cost model measured so is not one measured on huge pages
    assert machine_fingerprint()["weight_pages"] == "4 KiB"
