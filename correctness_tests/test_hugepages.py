"""kernels.hugepages.empty: the tensor torch.empty gives, its whole 2 MiB pages advised huge where
Linux takes the advice (and, under a hypervisor with several threads, faulted by the calling thread),
and left alone where it would not help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from correctness_tests.conftest import requires_cuda
from kernels import hugepages

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_advice(monkeypatch: pytest.MonkeyPatch):
    """The advice decided anew for the test (the decision is cached per process), and after it."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    hugepages._madvise.cache_clear()
    yield
    hugepages._madvise.cache_clear()


def test_empty_is_torch_empty_of_like() -> None:
    like = torch.zeros(3, dtype=torch.float64)
    for shape in [(0,), (5, 7), (4, 1 << 20)]:
        t = hugepages.empty(shape, like=like)
        assert t.shape == shape and t.dtype == like.dtype and t.device == like.device and t.is_contiguous()


# Run in a fresh process: in a test worker, earlier tests may have left glibc serving large blocks
# from a heap that an advised tensor once occupied (its flag stays), or perfgate's malloc mode on.
IN_A_FRESH_PROCESS = """
import torch
from pathlib import Path
from kernels import hugepages

def vm_flags(address):
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]

def interior(t):
    return -(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE

if hugepages._madvise() is None:
    print("no advice")
else:
    # 64 MiB: over glibc's largest mmap threshold, so each is a fresh mapping of its own
    advised, plain = hugepages.empty((16 << 20,), like=torch.zeros(1)), torch.empty(16 << 20)
    advised.fill_(1.0)
    print("hg" in vm_flags(interior(advised)), "hg" in vm_flags(interior(plain)), bool((advised == 1).all()))
"""


def test_interior_pages_advised_huge() -> None:
    """A tensor from ``empty`` has its 2 MiB pages advised huge (smaps' ``hg`` flag), a plain
    torch.empty beside it not; writing it works."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run([sys.executable, "-c", IN_A_FRESH_PROCESS], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    if out == "no advice":
        mode = Path(hugepages.THP_MODE).read_text().strip() if Path(hugepages.THP_MODE).exists() else "absent"
        pytest.skip(f"no advice taken here: {sys.platform}, THP mode {mode!r}")
    assert out == "True False True"


def test_advice_covers_the_whole_huge_pages_inside_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The range advised: 2 MiB-aligned, inside the tensor, every whole huge page of it."""
    calls = []
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda start, length, advice: calls.append((start, length,
                                                                                                  advice)) or 0)
    t = hugepages.empty((3 << 20,), like=torch.zeros(1))  # 12 MiB
    ((start, length, advice),) = calls
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * 4
    huge = hugepages.HUGE_PAGE
    assert advice == hugepages.MADV_HUGEPAGE and start % huge == 0 and length % huge == 0
    assert lo <= start < lo + huge and hi - huge < start + length <= hi
    calls.clear()
    hugepages.empty((1000,), like=torch.zeros(1))  # no whole huge page inside: no call
    assert calls == []


def _written_by_empty(monkeypatch: pytest.MonkeyPatch, **kwargs) -> tuple[torch.Tensor, list]:
    """A 12 MiB float32 tensor from ``empty`` (advice recorded, not given), allocated as 7s: what
    ``empty`` itself wrote reads 0."""
    calls = []
    monkeypatch.setattr(hugepages, "_madvise",
                        lambda: lambda start, length, advice: calls.append((start, length)) or 0)
    monkeypatch.setattr(hugepages.torch, "empty", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype))
    return hugepages.empty((3 << 20,), like=torch.zeros(1), **kwargs), calls


def test_prefault_writes_the_first_element_of_each_advised_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """prefault=True: one element at the start of every advised huge page is written (its fault maps
    the page), nothing else; prefault=False: nothing."""
    t, [(start, length)] = _written_by_empty(monkeypatch, prefault=True)
    written = (t == 0).nonzero().flatten().tolist()
    expected = [(page - t.data_ptr()) // 4 for page in range(start, start + length, hugepages.HUGE_PAGE)]
    assert written == expected and len(written) == length // hugepages.HUGE_PAGE
    t, _ = _written_by_empty(monkeypatch, prefault=False)
    assert (t == 7).all()


@pytest.mark.parametrize(("threads", "virtual", "prefaults"),
                         [(2, True, True), (1, True, False), (2, False, False)])
def test_prefault_by_default_under_a_hypervisor_with_several_threads(monkeypatch: pytest.MonkeyPatch, threads: int,
                                                                     virtual: bool, prefaults: bool) -> None:
    monkeypatch.setattr(hugepages.cpu, "virtual", lambda: virtual)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t, _ = _written_by_empty(monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert bool((t == 0).any()) == prefaults


PREFAULTED_IN_A_FRESH_PROCESS = """
import torch
from kernels import hugepages, nontemporal

if hugepages._madvise() is None or nontemporal._nontemporal is None:
    print("not here")
else:
    # 64 MiB: over glibc's largest mmap threshold, so each is a fresh mapping, not yet faulted
    for prefault in (False, True):
        t = hugepages.empty((16 << 20,), like=torch.zeros(1), prefault=prefault)
        lo = -(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
        inside = t.view(-1)[(lo - t.data_ptr()) // 4:][: 8 * hugepages.HUGE_PAGE // 4]
        print(nontemporal._nontemporal.resident(inside.numpy()))
"""


def test_prefaulted_pages_are_resident() -> None:
    """The prefault maps the advised pages (mincore reads them resident) before anything else
    writes the tensor; without it a fresh mapping has none."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run([sys.executable, "-c", PREFAULTED_IN_A_FRESH_PROCESS], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    if out == ["not here"]:
        pytest.skip("no THP advice taken here, or kernels._nontemporal (its mincore) not built")
    assert out == ["False", "True"]


@pytest.mark.usefixtures("fresh_advice")
def test_no_advice_where_torch_aligns_for_thp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert hugepages._madvise() is None


@pytest.mark.usefixtures("fresh_advice")
def test_no_advice_unless_madvise_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for mode in ["[always] madvise never", "always madvise [never]"]:
        (tmp_path / "enabled").write_text(mode + "\n")
        monkeypatch.setattr(hugepages, "THP_MODE", str(tmp_path / "enabled"))
        hugepages._madvise.cache_clear()
        assert hugepages._madvise() is None, mode
    monkeypatch.setattr(hugepages, "THP_MODE", str(tmp_path / "missing"))
    hugepages._madvise.cache_clear()
    assert hugepages._madvise() is None


@requires_cuda
def test_cuda_is_plain_empty() -> None:
    t = hugepages.empty((8 << 20,), like=torch.zeros(1, device="cuda"))
    assert t.device.type == "cuda" and t.shape == (8 << 20,)
