"""kernels.hugepages.empty: the tensor torch.empty gives, its whole 2 MiB pages advised huge where
Linux takes the advice, and left alone where it would not help."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from correctness_tests.conftest import requires_cuda
from kernels import hugepages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` in this process (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


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


@pytest.mark.usefixtures("fresh_advice")
def test_interior_pages_advised_huge() -> None:
    if hugepages._madvise() is None:
        mode = Path(hugepages.THP_MODE).read_text().strip() if Path(hugepages.THP_MODE).exists() else "absent"
        pytest.skip(f"no advice taken here: {sys.platform}, THP mode {mode!r}")
    t = hugepages.empty((4 << 20,), like=torch.zeros(1))  # 16 MiB
    start = t.data_ptr()
    interior = -(-start // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    assert "hg" in _vm_flags(interior)
    # A plain allocation of the same size, for contrast, is not advised.
    plain = torch.empty(4 << 20)
    plain_interior = -(-plain.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    assert "hg" not in _vm_flags(plain_interior)
    t.fill_(1.0)
    assert bool((t == 1.0).all())


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
