"""kernels.hugepages.empty: the tensor torch.empty gives, its whole 2 MiB pages advised huge where
Linux takes the advice, huge unasked where its THP mode is ``always``, faulted by the calling thread
on request, and left alone where it would not help; kernels.hugepages.fresh: the same tensor, faulted
(under a hypervisor with several threads) the way its site's recent calls found faster."""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from correctness_tests.conftest import requires_cuda, torch_threads
from kernels import hugepages

ROOT = Path(__file__).resolve().parents[1]


def _decide_anew() -> None:
    """Forget the THP mode and the advice function read so far (each is cached per process)."""
    for cached in (hugepages._mode, hugepages._madvise):
        cached.cache_clear()


@pytest.fixture
def fresh_advice(monkeypatch: pytest.MonkeyPatch):
    """The advice decided anew for the test, and after it."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    _decide_anew()
    yield
    _decide_anew()


def test_empty_is_torch_empty_of_like() -> None:
    like = torch.zeros(3, dtype=torch.float64)
    for shape in [(0,), (5, 7), (4, 1 << 20)]:
        t = hugepages.empty(shape, like=like)
        assert t.shape == shape and t.dtype == like.dtype and t.device == like.device and t.is_contiguous()


def _in_a_fresh_process(script: str) -> str:
    """``script``'s output, run by this Python in a fresh process with the checkout importable: in a
    test worker, earlier tests may have left glibc serving large blocks from a heap that an advised
    tensor once occupied (its flag stays, its pages mapped), or perfgate's malloc mode on."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


ADVISED = """
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

if hugepages._madvise() is None:
    print("no advice")
else:
    # 64 MiB: over glibc's largest mmap threshold, so each is a fresh mapping of its own
    advised, plain = hugepages.empty((16 << 20,), like=torch.zeros(1)), torch.empty(16 << 20)
    advised.fill_(1.0)
    print("hg" in vm_flags(hugepages.interior(advised)[0]), "hg" in vm_flags(hugepages.interior(plain)[0]),
          bool((advised == 1).all()))
"""


def test_interior_pages_advised_huge() -> None:
    """A tensor from ``empty`` has its 2 MiB pages advised huge (smaps' ``hg`` flag), a plain
    torch.empty beside it not; writing it works."""
    out = _in_a_fresh_process(ADVISED)
    if out == "no advice":
        pytest.skip(f"no advice taken here: {sys.platform}, THP mode {hugepages._mode() or 'unreadable'!r}")
    assert out == "True False True"


@pytest.fixture
def advice(monkeypatch: pytest.MonkeyPatch) -> list:
    """madvise recorded, not given: the (start, length, advice) of each call, each answered 0 (taken)."""
    calls: list = []
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda *call: calls.append(call) or 0)
    return calls


def test_advice_covers_the_whole_huge_pages_inside_the_tensor(advice: list) -> None:
    """The range advised: 2 MiB-aligned, inside the tensor, every whole huge page of it."""
    t = hugepages.empty((3 << 20,), like=torch.zeros(1))  # 12 MiB
    ((start, length, how),) = advice
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * 4
    huge = hugepages.HUGE_PAGE
    assert how == hugepages.MADV_HUGEPAGE and start % huge == 0 and length % huge == 0
    assert lo <= start < lo + huge and hi - huge < start + length <= hi
    assert hugepages.interior(t) == (start, start + length)
    advice.clear()
    hugepages.empty((1000,), like=torch.zeros(1))  # no whole huge page inside: no call
    assert advice == []


MARK = 0xAB  # the byte a tensor "allocated" by the tests below holds before empty writes to it


def _bytes_written(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype = torch.float32, *, fresh: bool = False,
                   **kwargs) -> tuple[list[int], tuple[int, int]]:
    """The addresses of the bytes ``empty`` (``fresh``: ``fresh``, its block writing nothing) wrote in a
    12 MiB tensor of ``dtype`` allocated holding MARK bytes, and the tensor's whole huge pages
    (``interior``)."""
    size = torch.zeros((), dtype=dtype).element_size()

    def allocated(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full((shape[0] * size,), MARK, dtype=torch.uint8).view(dtype)

    monkeypatch.setattr(hugepages.torch, "empty", allocated)
    shape, like = ((12 << 20) // size,), torch.zeros(1, dtype=dtype)
    if fresh:
        with hugepages.fresh(shape, like=like, site="test", **kwargs) as t:
            pass
    else:
        t = hugepages.empty(shape, like=like, **kwargs)
    written = [t.data_ptr() + i for i in (t.view(torch.uint8) != MARK).nonzero().flatten().tolist()]
    return written, hugepages.interior(t)


@pytest.fixture(autouse=True)
def no_times_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fresh``'s kept times, none before the test and the process's own left as they were."""
    monkeypatch.setattr(hugepages, "_sites", collections.OrderedDict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bfloat16, torch.complex128])
def test_prefault_writes_the_first_byte_of_each_advised_page(advice: list, monkeypatch: pytest.MonkeyPatch,
                                                             dtype: torch.dtype) -> None:
    """prefault=True: the first byte of every advised huge page is written (its fault maps the page),
    nothing else; prefault=False: nothing."""
    written, _ = _bytes_written(monkeypatch, dtype, prefault=True)
    ((start, length, _),) = advice
    assert written == list(range(start, start + length, hugepages.HUGE_PAGE)) and len(written) >= 5
    advice.clear()
    assert _bytes_written(monkeypatch, dtype, prefault=False)[0] == []


@pytest.mark.usefixtures("advice")
@pytest.mark.parametrize(("threads", "virtual", "writes"), [(2, True, True), (1, True, False), (2, False, False)])
def test_fresh_prefaults_first_under_a_hypervisor_with_several_threads(
        monkeypatch: pytest.MonkeyPatch, threads: int, virtual: bool, writes: bool) -> None:
    """``fresh``'s first call of a site prefaults under a hypervisor at 2 threads or more, and its
    time is kept; elsewhere it never prefaults and keeps nothing; ``empty`` prefaults on request only."""
    monkeypatch.setattr(hugepages.cpu, "virtual", lambda: virtual)
    with torch_threads(threads):
        assert bool(_bytes_written(monkeypatch, fresh=True)[0]) == writes
        assert len(hugepages._sites) == writes
        assert _bytes_written(monkeypatch)[0] == []
        assert _bytes_written(monkeypatch, prefault=True)[0] != []


@pytest.mark.usefixtures("advice")
def test_no_prefault_where_torch_fills_uninitialized_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's deterministic mode fills a fresh tensor (NaN): a prefault's zeros would break that fill."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    monkeypatch.setattr(hugepages.cpu, "virtual", lambda: True)
    try:
        assert _bytes_written(monkeypatch, prefault=True)[0] == []
        with torch_threads(2):
            assert _bytes_written(monkeypatch, fresh=True)[0] == [] and not hugepages._sites
    finally:
        torch.use_deterministic_algorithms(before)


class _Host:
    """A host whose clock moves only as ``fresh``'s blocks run: a block lasts ``seconds[way]`` for the
    way ``fresh`` took (True: prefaulted), each recorded in ``taken``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now, self.taken, self.seconds, self.starts = 0.0, [], {True: 0.020, False: 0.010}, []
        monkeypatch.setattr(hugepages, "_clock", lambda: self.now)
        monkeypatch.setattr(hugepages, "_prefault", lambda out: self.taken.append(True))
        monkeypatch.setattr(hugepages.cpu, "virtual", lambda: True)

    def call(self, site: str = "s", elements: int = 3 << 20) -> bool:
        """One call of ``fresh`` (12 MiB of float32 by default); the way it took."""
        before = len(self.taken)
        self.starts.append(self.now)
        with hugepages.fresh((elements,), like=torch.zeros(1), site=site):
            way = len(self.taken) > before
            if not way:
                self.taken.append(False)
            self.now += self.seconds[way]
        return way

    def calls(self, n: int, **kwargs) -> list[bool]:
        return [self.call(**kwargs) for _ in range(n)]


def _tries(taken: list[bool]) -> list[tuple[bool, int]]:
    """``taken`` as runs: (way, how many calls in a row)."""
    return [(way, len(list(calls))) for way, calls in itertools.groupby(taken)]


@pytest.mark.usefixtures("advice")
def test_fresh_takes_the_faster_way_and_tries_the_other_ever_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each way once (the prefault first), then the one with the lower median of its latest times;
    the other tried after EXPLORE_S seconds (and EXPLORE_CALLS calls), twice as far apart after each
    try slower than the faster way's median, as soon again after a faster one, and taken back where
    it has become the faster."""
    host = _Host(monkeypatch)

    def tried(way: bool, first: int) -> list[float]:
        """Seconds between one call taking ``way`` and the next, from the ``first``-th call on."""
        at = [start for start, took in zip(host.starts[first:], host.taken[first:], strict=True) if took == way]
        return [b - a for a, b in itertools.pairwise(at)]

    with torch_threads(2):
        assert host.calls(4) == [True, False, False, False]  # the writers' 10 ms against the prefault's 20
        host.calls(3 * int(hugepages.EXPLORE_S / host.seconds[False]) + 8)
        # tried at EXPLORE_S after the prefault ran (at 0), then 2 EXPLORE_S after that try
        assert [round(s / hugepages.EXPLORE_S, 2) for s in tried(True, 0)] == [1.0, 2.0]
        host.seconds[False] = 0.100  # now the writers fault slowly: the median of their last 3 turns in 2 calls
        assert host.calls(4) == [False, False, True, True]
        host.seconds[False] = 0.010  # fast again: a try faster than the prefault tries again after EXPLORE_S
        first = len(host.taken) - 3  # the writers' last slow call
        runs = _tries(host.calls(3 * int(hugepages.EXPLORE_S / host.seconds[True]) + 8))
        assert [way for way, _ in runs] == [True, False, True, False] and runs[1][1] == 1 and runs[3][1] >= 3
        assert [round(s / hugepages.EXPLORE_S, 2) for s in tried(False, first)][:3] == [1.0, 1.0, 0.0]


@pytest.mark.usefixtures("advice")
def test_fresh_tries_the_slower_way_after_calls_as_well_as_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls far apart (a training loop's epochs): the slower way is tried after EXPLORE_CALLS calls,
    then 2, 4, ... times as many, up to MAX_BACKOFF times."""
    host = _Host(monkeypatch)
    with torch_threads(2):
        taken = []
        for _ in range(2 + 10 * hugepages.MAX_BACKOFF * hugepages.EXPLORE_CALLS):
            host.now += 2 * hugepages.EXPLORE_S * hugepages.MAX_BACKOFF
            taken.append(host.call())
    calls = hugepages.EXPLORE_CALLS
    between = [n for way, n in _tries(taken)[1:] if not way]
    assert between[:6] == [calls, 2 * calls, 4 * calls, 8 * calls, 16 * calls, 16 * calls]


@pytest.mark.usefixtures("advice")
def test_fresh_keeps_times_per_site_size_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A site, a size or a thread count of its own starts with the prefault; a block that raises keeps
    no time; past SITES keys the least recently used is forgotten."""
    host = _Host(monkeypatch)
    with torch_threads(2):
        assert host.calls(3) == [True, False, False]
        assert host.call(site="other") and host.call(elements=4 << 20) and not host.call()
    with torch_threads(3):
        assert host.call()
    assert len(hugepages._sites) == 4
    with torch_threads(2), pytest.raises(RuntimeError, match="a failed write"):
        with hugepages.fresh((5 << 20,), like=torch.zeros(1), site="s"):
            raise RuntimeError("a failed write")
    assert hugepages._sites[("s", 20 << 20, 2)].seconds == {True: collections.deque(maxlen=hugepages.KEPT),
                                                             False: collections.deque(maxlen=hugepages.KEPT)}
    monkeypatch.setattr(hugepages, "SITES", 3)
    with torch_threads(2):
        host.call(site="newest")
    assert [site for site, _, _ in hugepages._sites] == ["s", "s", "newest"]


def test_no_prefault_where_the_advice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda *call: -1)
    assert _bytes_written(monkeypatch, prefault=True)[0] == []


@pytest.mark.parametrize("unasked", [True, False])
def test_huge_unasked_prefaulted_without_advice(monkeypatch: pytest.MonkeyPatch, unasked: bool) -> None:
    """THP ``always`` (pages huge unasked, no madvise to call): no advice, the same bytes prefaulted
    (the first of each whole huge page), and ``fresh`` the same; THP ``never``: nothing written."""
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)
    monkeypatch.setattr(hugepages, "_huge_unasked", lambda: unasked)
    monkeypatch.setattr(hugepages.cpu, "virtual", lambda: True)
    written, (lo, hi) = _bytes_written(monkeypatch, prefault=True)
    assert hi - lo >= 5 * hugepages.HUGE_PAGE
    assert written == (list(range(lo, hi, hugepages.HUGE_PAGE)) if unasked else [])
    with torch_threads(2):
        assert bool(_bytes_written(monkeypatch, fresh=True)[0]) == unasked
    with torch_threads(1):
        assert _bytes_written(monkeypatch, fresh=True)[0] == []


PREFAULTED = """
import torch
from kernels import hugepages, nontemporal

if (hugepages._madvise() is None and not hugepages._huge_unasked()) or nontemporal._nontemporal is None:
    print("not here")
else:
    # 64 MiB: over glibc's largest mmap threshold, so each is a fresh mapping, not yet faulted; the
    # first 4 KiB of each of its first 8 huge pages (advised or unasked) read by mincore (mapped whole
    # where Linux has the huge page, those 4 KiB where it falls back to small ones)
    for prefault in (False, True):
        t = hugepages.empty((16 << 20,), like=torch.zeros(1), prefault=prefault)
        lo, _ = hugepages.interior(t)
        pages = t.view(torch.uint8)[lo - t.data_ptr():]
        print(all(nontemporal._nontemporal.resident(pages[k * hugepages.HUGE_PAGE:][:4096].numpy())
                  for k in range(8)))
"""


def test_prefaulted_pages_are_mapped() -> None:
    """The prefault maps the huge pages (advised or unasked; mincore reads them resident) before
    anything else writes the tensor; without it a fresh mapping has none of them."""
    out = _in_a_fresh_process(PREFAULTED)
    if out == "not here":
        pytest.skip("no THP here (mode never, or unreadable), or kernels._nontemporal (its mincore) not built")
    assert out.split() == ["False", "True"]


@pytest.mark.usefixtures("fresh_advice")
def test_nothing_asked_where_torch_aligns_for_thp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """THP_MEM_ALLOC_ENABLE=1 (torch aligns and advises its own allocations): neither advice nor a
    prefault of pages huge unasked, whatever the mode."""
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setattr(hugepages, "THP_MODE", str(tmp_path / "enabled"))
    for text in ["always [madvise] never", "[always] madvise never"]:
        (tmp_path / "enabled").write_text(text + "\n")
        _decide_anew()
        assert hugepages._madvise() is None and not hugepages._huge_unasked(), text


@pytest.mark.usefixtures("fresh_advice")
def test_thp_mode_decides_advice_and_unasked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """madvise only in ``madvise`` mode; huge pages unasked only in ``always`` mode; neither where the
    mode file is missing or marks no mode."""
    modes = [("always [madvise] never", True, False), ("[always] madvise never", False, True),
             ("always madvise [never]", False, False)]
    for text, advised, unasked in modes:
        (tmp_path / "enabled").write_text(text + "\n")
        monkeypatch.setattr(hugepages, "THP_MODE", str(tmp_path / "enabled"))
        _decide_anew()
        assert (hugepages._madvise() is not None, hugepages._huge_unasked()) == (advised, unasked), text
    for text in ["madvise [always\n", "always madvise never\n"]:  # no mode marked: none read
        (tmp_path / "enabled").write_text(text)
        assert hugepages._bracketed(str(tmp_path / "enabled")) == "", text
    monkeypatch.setattr(hugepages, "THP_MODE", str(tmp_path / "missing"))
    _decide_anew()
    assert hugepages._madvise() is None and not hugepages._huge_unasked()


@requires_cuda
def test_cuda_is_plain_empty() -> None:
    t = hugepages.empty((8 << 20,), like=torch.zeros(1, device="cuda"))
    assert t.device.type == "cuda" and t.shape == (8 << 20,)
