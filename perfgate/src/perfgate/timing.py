"""Device-correct timing and peak memory.

Every timed call is read by a ``Clock`` as a pair of marks around it, and a ``Timer`` times
blocks of back-to-back calls: marks for every call of the block, one wait at the block's end,
then the seconds between each call's marks. On CPU a mark is a host clock read. On CUDA,
where kernels are asynchronous, it is a CUDA event recorded on the stream: the event pair
brackets the call's work on the device, and the host is not stopped between calls. A host
clock read after ``torch.cuda.synchronize`` per call would add the synchronize and the next
launch to every reading, which at tens of microseconds a kernel is a large part of it and
pulls speedups toward 1 (the design and its reasons: docs/perfgate.md, "Timing on CUDA").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import mmap
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


def torch_or_none() -> Any:
    """torch when it is installed, else None: perfgate times plain Python callables too."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def resolve_device(requested: str) -> str:
    """``auto`` means cuda when available, else cpu; ``cuda`` without a GPU is an error."""
    if requested != "auto" and requested != "cpu" and not requested.startswith("cuda"):
        raise ValueError(f"--perf-device must be auto, cpu or cuda[:N], got {requested!r}")
    torch = torch_or_none() if requested != "cpu" else None
    cuda = torch is not None and torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    if requested.startswith("cuda") and not cuda:
        why = "torch is not installed" if torch is None else "no CUDA device is available"
        raise ValueError(f"--perf-device {requested}: {why}; use --perf-device cpu")
    return requested


def synchronizer(device: str) -> Callable[[], None]:
    """A no-argument function that waits for all queued work on ``device``."""
    if device.startswith("cuda"):
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def synced(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` followed by a device synchronize: a wall-clock reading around it (the first call,
    the sizing call, peak memory) sees the whole duration."""
    sync = synchronizer(device)

    def run(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        sync()
        return out

    return run


class Clock(Protocol):
    """Marks placed before and after calls, read as seconds once ``wait`` has returned."""

    name: str  # what the readings come from (pytest-benchmark's JSON names it as its timer)

    def ready(self, marks: int) -> None: ...

    def mark(self) -> Any: ...

    def wait(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class HostClock:
    """CPU: a mark is a reading of ``timer`` (seconds), nothing to wait for."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer, self.name = timer, getattr(timer, "__name__", repr(timer))

    def ready(self, marks: int) -> None:
        pass

    def mark(self) -> float:
        return self.timer()

    def wait(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """CUDA: a mark is an event recorded on the device's current stream; it takes its time when
    the device reaches it, after the work queued before it. ``ready`` creates a block's events and
    looks up the stream before the block, so a mark costs only its record; ``wait`` synchronizes
    once."""

    name = "torch.cuda.Event"

    def __init__(self, device: str) -> None:
        import torch

        self.device, self.torch = device, torch
        self.events: list[Any] = []
        self.used, self.stream = 0, None

    def ready(self, marks: int) -> None:
        self.stream = self.torch.cuda.current_stream(self.device)
        while len(self.events) < marks:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record(self.stream)  # a CUDA event is created at its first record: now, not in a reading
            self.events.append(event)
        self.used = 0

    def mark(self) -> Any:
        event = self.events[self.used]
        self.used += 1
        event.record(self.stream)
        return event

    def wait(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


L2_FLUSH_BYTES = 256 * 2**20  # over any GPU's L2 (H100: 50 MB), as triton.testing.do_bench zeroes


def l2_flusher(device: str) -> Callable[[], Any]:
    """``--perf-l2-flush``: a call that overwrites the GPU's L2 (zeroes a 256 MiB buffer), run
    before each timed call and outside its marks, so each call starts with cold caches."""
    import torch

    buffer = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return buffer.zero_


Timed = tuple[Callable[..., Any], Callable[[], Any] | None]  # (callable, its per-call setup or None)


class HeapShift:
    """A spacer of random size (``step`` to ``most`` bytes, in ``step``s) taken from the C heap and
    held over each block (``Timer.rounds``), so the block's outputs and temporaries land past it: at
    another place of the heap each block. Under the ``cache`` malloc mode a process serves a call's
    buffers from the same place of its heap call after call, and where that place falls can hold
    all of a process's blocks 30-40% off another process's running the same code: a lasting offset
    that no number of its own blocks averages away. Shifted, every block samples the layouts, and
    the offset becomes the blocks' noise, which the pairs average (docs/perfgate.md, "Units"). The
    spacer is the calling thread's: glibc gives other threads (an OpenMP team's) arenas of their own."""

    def __init__(self, most: int = 16 << 20, step: int = 64) -> None:
        if not (step >= 1 and most >= step):
            raise ValueError(f"HeapShift needs step >= 1 and most >= step bytes, got step={step}, most={most}")
        self.most, self.step = most, step
        self.rng = random.Random()
        libc = ctypes.CDLL("libc.so.6")
        self.malloc, self.free = libc.malloc, libc.free
        self.malloc.restype, self.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        self.free.restype, self.free.argtypes = None, [ctypes.c_void_p]

    @staticmethod
    def open() -> HeapShift | None:
        """A shift on glibc (the cache malloc mode's allocator); None where there is no libc.so.6."""
        try:
            return HeapShift()
        except (OSError, AttributeError):
            return None

    @contextlib.contextmanager
    def held(self, nbytes: int | None = None) -> Any:
        """A spacer of ``nbytes`` (None: of random size), held while the ``with`` body runs; the
        program never writes it (malloc writes its own headers)."""
        if nbytes is None:
            nbytes = self.step + self.rng.randrange(0, self.most, self.step)
        spacer = self.malloc(nbytes)
        try:
            yield spacer
        finally:
            self.free(spacer)  # free(NULL), where malloc refused, does nothing


@dataclass
class Timer:
    """Times calls of one device with ``clock``. ``flush`` (CUDA's L2 flush) runs before each call;
    ``overhead_s`` is what it adds to a call's wall time, outside the reading (budgets count it).
    ``disable_gc``: Python's garbage collector is off during a block (--benchmark-disable-gc).
    ``shift``: a ``HeapShift`` held over each block, warming calls included."""

    clock: Clock
    flush: Callable[[], Any] | None = None
    overhead_s: float = 0.0
    disable_gc: bool = False
    shift: HeapShift | None = None

    def shifted(self, largest: bool = False) -> contextlib.AbstractContextManager:
        """``shift``'s spacer held over a ``with`` body (of random size, or its ``largest``); nothing
        where the timer has no shift."""
        if self.shift is None:
            return contextlib.nullcontext()
        return self.shift.held(self.shift.most if largest else None)

    def cost(self, seconds: float) -> float:
        """Wall seconds of a call that reads ``seconds``: what a block of it takes."""
        return seconds + self.overhead_s

    def block(self, timed: Timed, calls: int, warm: int = 1,
              warmed: Callable[[], Any] | None = None) -> list[float]:
        """Seconds of each of ``calls`` back-to-back calls after ``warm`` untimed ones; ``warmed`` is
        called between the two (a host-load reading of the timed calls alone)."""
        return self.rounds(timed, calls, warm, warmed)[0]

    def rounds(self, timed: Timed, calls: int, warm: int = 1,
               warmed: Callable[[], Any] | None = None) -> tuple[list[float], Any]:
        """``block``'s seconds, and what the last call returned. Each call's setup (and the flush)
        runs before its first mark, so neither is in its reading; nothing waits for the device
        until the block's end."""
        fn, setup = timed
        marks, out = [], None
        self.clock.ready(2 * (warm + calls))
        collecting = gc.isenabled()
        if self.disable_gc:
            gc.disable()
        try:
            with self.shifted():
                for i in range(warm + calls):
                    if i == warm and warmed is not None:
                        warmed()
                    args = () if setup is None else (setup(),)
                    if self.flush is not None:
                        self.flush()
                    start = self.clock.mark()
                    out = fn(*args)
                    end = self.clock.mark()
                    if i >= warm:
                        marks.append((start, end))
        finally:
            if collecting:
                gc.enable()
        self.clock.wait()
        return [self.clock.seconds(start, end) for start, end in marks], out


def timer_for(device: str, *, l2_flush: bool = False, host_timer: Callable[[], float] = time.perf_counter,
              disable_gc: bool = False, shift_heap: bool = False) -> Timer:
    """The session's timer: CUDA events on a CUDA device (with the L2 flush when asked, its cost
    measured once), else ``host_timer`` (pytest-benchmark's ``--benchmark-timer``), with a
    ``HeapShift`` over each block where ``shift_heap`` (for the ``cache`` malloc mode)."""
    if not device.startswith("cuda"):
        return Timer(HostClock(host_timer), disable_gc=disable_gc, shift=HeapShift.open() if shift_heap else None)
    clock = CudaEventClock(device)
    if not l2_flush:
        return Timer(clock, disable_gc=disable_gc)
    flush = l2_flusher(device)
    overhead = _median(Timer(clock).block((flush, None), 3))  # the flush read as any call is
    return Timer(clock, flush, overhead, disable_gc)


MEMINFO = "/proc/meminfo"  # its MemAvailable: available_memory


def available_memory() -> int | None:
    """Bytes of memory Linux says a new allocation can take (``MemAvailable``); None where unread."""
    try:
        with open(MEMINFO, encoding="utf8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def proc_status_bytes(key: str) -> int | None:
    """Bytes of this process's ``key`` line in /proc/self/status (VmRSS, VmHWM); None where unread."""
    try:
        with open("/proc/self/status", encoding="utf8") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters


def configure_malloc(mode: str) -> str:
    """``cache``: glibc serves every block from its heap (no mmap) and keeps freed memory
    (trims only above 2 GiB free), so a fresh tensor reuses resident pages, as CUDA's caching
    allocator does. Without it a large tensor (a (B, P) per-sample gradient) is mmap-ed and
    page-faulted anew on every call, or not, depending on what ran before, which moved timings
    several-fold (evidence/from-the-code.md). Returns the mode in effect ("default"
    where mallopt is absent)."""
    if mode != "cache":
        return "default"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return "default"
    return "cache" if ok else "default"


def _release_free_heap() -> None:
    """Hand glibc's free heap pages back to the OS, so a call cannot reuse pages an earlier
    call left resident and read as using no memory (no-op off glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory(fn: Callable[[], Any], device: str) -> int | None:
    """Peak memory one call of ``fn`` adds, in bytes, above what was in use before it.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus the allocation before the call.
    CPU (Linux): free heap pages are returned to the OS (glibc ``malloc_trim``), the process's
    resident-set high-water mark is reset (``/proc/self/clear_refs`` with 5), and
    ``VmHWM - VmRSS(before)`` is read after the call: the pages the call touched at its peak.
    Memory an allocator keeps cached outside glibc's heap would still be reused uncounted, so
    this is a lower bound of the footprint. None where neither measure is available.
    """
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        synced(fn, device)()
        return int(torch.cuda.max_memory_allocated(device) - before)
    _release_free_heap()
    before = proc_status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf8") as fh:
            fh.write("5")
    except OSError:
        return None
    fn()
    after = proc_status_bytes("VmHWM")
    if before is None or after is None:
        return None
    return max(0, after - before)


# A block lasts at least BLOCK_S (up to 8 calls): short kernels repeat. A call this long (WARM_S) is
# timed in its block without a warming call first: refilling the caches is a small share of it, and
# a warming call would cost as much as the reading (docs/gate.md, "Stop measuring what is decided")
BLOCK_S = 0.02
WARM_S = 0.1


def block_calls(seconds: float) -> tuple[int, int]:
    """(timed calls, untimed warming calls) of an interleaved block of a call lasting ``seconds``:
    the session's pairs (case.py) and ``--perf-against``'s (abrun.py) size their blocks alike."""
    return max(1, min(8, math.ceil(BLOCK_S / max(seconds, 1e-9)))), int(seconds < WARM_S)


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True)
class PairLoad:
    """What the host withheld while one interleaved pair ran (``HostLoad``)."""

    wall: float  # seconds the pair took
    share: float  # share of the CPU time withheld (``HostLoad.share``)
    delay: float  # most seconds the withholding could have added to the impl's timed calls in the pair
    reference_delay: float = 0.0  # the same around the reference's timed calls (what it could have added there)
    gbps: float | None = None  # the streaming probe beside the pair's stretch (``Bandwidth``), GB/s
    round_trip_ns: float | None = None  # the threads' round trip before or after the pair, the larger (RoundTrip)
    pace_ns: float | None = None  # the core's pace before or after the pair, the slower (Pace)


class Bandwidth:
    """A streaming probe: copies of a ``nbytes`` buffer (twice the 32 MiB L3 of the hosts measured,
    so it streams from memory) on one thread, read as GB/s moved (read + write). A neighbour that
    takes memory bandwidth, which /proc does not show (another VM on the same socket), slows it as
    it slows a memory-bound kernel. Read beside each stretch of pairs and compared with the
    session's quiet figure (``GateState.quiet_gbps``)."""

    def __init__(self, nbytes: int = 64 * 2**20, copies: int = 3) -> None:
        import numpy as np

        # mapped apart from malloc's heap, whose top the CPU peak-memory reading trims; written now,
        # so a reading takes no page faults
        self.src, self.dst = (np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.float64) for _ in range(2))
        self.src.fill(1.0)
        self.dst.fill(0.0)
        self.nbytes, self.copies = 2 * self.src.nbytes, copies  # read + written

    @staticmethod
    @functools.cache
    def shared() -> Bandwidth:
        """The process's probe: a second session in one process (pytester) reuses its 128 MiB,
        written once (145 ms of page faults on the Zen 3)."""
        return Bandwidth()

    def read(self) -> float:
        """GB/s of the best of ``copies`` copies (one slow copy is a hiccup, not the host's bandwidth)."""
        import numpy as np

        best = float("inf")
        for _ in range(self.copies):
            start = time.perf_counter()
            np.copyto(self.dst, self.src)
            best = min(best, time.perf_counter() - start)
        return self.nbytes / max(best, 1e-9) / 1e9


class RoundTrip:
    """How far apart the host placed torch's threads: the cache-line round trip, ns, between the
    calling thread and each other thread of torch's OpenMP team (``_roundtrip.c``), the slowest
    partner's. A VM's vCPUs move between physical cores: two that share a last-level cache pass a
    line in about 50 ns on the Zen 4 measured, two on different dies in about 320, and a 2-thread
    kernel whose ops hand each other's rows across (the Standardizer) then runs 2x as long while
    every other reading, and the single-threaded reference, stay as they were (docs/gate.md, "The
    threads' placement"). Read between interleaved pairs: 100 round trips, 3 times (about 20 us
    near, 100 apart)."""

    def __init__(self, threads: int, bounces: int = 100, reps: int = 3) -> None:
        import torch  # first: the module's libgomp.so.1 is then torch's, and its team torch's pool

        from . import _roundtrip

        self.torch, self.module = torch, _roundtrip
        self.threads, self.bounces, self.reps = threads, bounces, reps

    @staticmethod
    def open(threads: int | None) -> RoundTrip | None:
        """The probe for a session at ``threads`` torch threads; None where there is nothing to
        read (one thread), where it was not built (no C compiler at install), or where its
        OpenMP runtime is not torch's (its team would then be a second pool, contending with
        torch's): perfgate reads no placement then, and judges every row as before."""
        if threads is None or threads < 2:
            return None
        try:
            probe = RoundTrip(threads)
        except ImportError:
            return None
        ours, torchs = openmp_runtime(probe.module.__file__), torch_openmp_runtime()
        return probe if ours is None or torchs is None or ours == torchs else None

    def read(self) -> float | None:
        """The slowest partner's median round trip, ns (inf where a partner did not run for 50 ms);
        None where torch's team has one thread now, or OpenMP gave the probe one."""
        team = min(self.threads, self.torch.get_num_threads())
        trips = self.module.round_trip(team, self.bounces, self.reps) if team >= 2 else ()
        return max(trips) if trips else None


class Pace:
    """How fast the host runs the timing thread's core now: nanoseconds for a fixed pure-Python
    loop (``loop`` additions), the best of ``reps``. Two vCPUs of one VM need not run at one speed,
    and a kernel and its reference need not slow alike on a slowed one, so a speedup timed there is
    not the machine's usual one; steal and run-queue wait do not show it (docs/gate.md, "The core's
    pace", has the measurements). Read between interleaved pairs: about 0.1 ms."""

    def __init__(self, loop: int = 2000, reps: int = 3) -> None:
        if loop < 1 or reps < 1:
            raise ValueError(f"Pace(loop, reps): both >= 1, got {loop}, {reps}")
        self.loop, self.reps = loop, reps

    def read(self) -> float:
        """The best of ``reps`` timings of the loop, ns."""
        best = float("inf")
        for _ in range(self.reps):
            start = time.perf_counter_ns()
            total = 0
            for i in range(self.loop):
                total += i
            best = min(best, time.perf_counter_ns() - start)
        return float(best)

    def scan(self, seconds: float = 0.0, every: float = 0.1, most: int = 64) -> float | None:
        """The pace of the fastest CPU this thread may run on: the calling thread is moved to each
        of them in turn (at most ``most``), the fastest reading kept, every ``every`` seconds for
        ``seconds`` (one pass at least), and the median of those passes returned (each vCPU turns
        slow and fast on its own, for about a second at a time on the Xeon 207: the median pass
        finds one at full pace). The thread is put back where it was allowed. None where the
        platform cannot move a thread (not Linux) or allows it one CPU."""
        passes: list[float] = []
        end = time.perf_counter() + seconds
        while True:
            fastest = self.fastest(most)
            if fastest is None:
                return None
            passes.append(fastest[1])
            if time.perf_counter() + every > end:
                return float(sorted(passes)[len(passes) // 2])
            time.sleep(every)

    def fastest(self, most: int = 64) -> tuple[int, float] | None:
        """(the CPU, its pace) of the fastest CPU this thread may run on now, one reading each (at
        most ``most``); the thread is put back where it was allowed. None as for ``scan``."""
        if not hasattr(os, "sched_setaffinity"):
            return None
        allowed = os.sched_getaffinity(0)
        if len(allowed) < 2:
            return None
        read = []
        try:
            for cpu in sorted(allowed)[:most]:
                os.sched_setaffinity(0, {cpu})
                read.append((self.read(), cpu))
        except OSError:  # a CPU taken offline, a cpuset changed, or moving threads refused
            return None
        finally:
            allow(allowed)
        pace, cpu = min(read)
        return cpu, pace


def allow(cpus: set[int]) -> bool:
    """Allow the calling thread ``cpus`` again (``os.sched_setaffinity``); False where the platform
    refuses (a cpuset that shrank meanwhile, a sandbox): the thread then stays where it was."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    return True


def pin(cpu: int) -> set[int] | None:
    """Run the calling thread on ``cpu`` alone: the CPUs it was allowed, to give back with
    ``allow``; None where it cannot be moved (not Linux, or refused), and it runs as it was."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    return allowed if allow({cpu}) else None


def torch_openmp_runtime() -> str | None:
    """The OpenMP runtime torch's CPU library runs its intra-op pool on (``openmp_runtime`` of
    ``libtorch_cpu``); None where that library or its runtime is not found."""
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    return openmp_runtime(lib) if os.path.exists(lib) else None


def openmp_runtime(extension: str) -> str | None:
    """The file of the OpenMP runtime whose ``omp_get_num_threads`` a loaded C extension (its
    path) calls, resolved as the loader resolved it (``dlsym`` on its handle, ``dladdr``); None
    where the extension has no OpenMP or this is not a glibc system. ``RoundTrip``'s module and
    kernels' ``_nontemporal`` must name torch's copy: their threads are then torch's pool."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        symbol = ctypes.CDLL(extension).omp_get_num_threads
        info = DlInfo()
        found = ctypes.CDLL(None).dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info))
    except (OSError, AttributeError):
        return None
    return os.path.realpath(info.dli_fname.decode()) if found and info.dli_fname else None


@dataclass
class HostLoad:
    """How much the host withheld from this process while it was timed: CPU time from Linux's
    /proc, and, with ``probe``, memory bandwidth. Interleaving cancels a host state both sides of
    a pair share, but not these: a kernel on 2 threads whose second CPU is taken waits at every
    parallel region, while a single-threaded reference barely notices; a memory-bound kernel
    slows with the bandwidth a neighbour takes, a compute-bound reference does not (measured in
    docs/gate.md, "A contended host").

    Withheld = the hypervisor's steal (``/proc/stat``) over the machine's ``cpus``, plus the lesser
    of two shares that must agree: the run-queue wait of this process's threads (runnable, no CPU
    free: ``/proc/self/task/*/schedstat``) over ``threads``, and the CPU time other processes ran
    (the machine's busy time less this process's) over ``cpus``. Wait alone would also count our
    own pools competing (torch's OpenMP beside a peer's spinning OpenBLAS read 0.6 on a quiet
    host); others' time alone would count a neighbour on a CPU we do not use."""

    threads: int
    cpus: int = os.cpu_count() or 1
    probe: Bandwidth | None = None
    placement: RoundTrip | None = None
    pace: Pace | None = None

    def read(self) -> tuple[float, ...] | None:
        """(wall s, steal s and others' busy s summed over the CPUs, run-queue wait s summed over the
        threads), or None where /proc gives them not (not Linux)."""
        try:
            import resource  # POSIX only

            with open("/proc/stat", encoding="ascii") as fh:
                user, nice, system, _, _, irq, softirq, steal = (int(v) for v in fh.readline().split()[1:9])
            tick = os.sysconf("SC_CLK_TCK")
            usage = resource.getrusage(resource.RUSAGE_SELF)
            others = (user + nice + system + irq + softirq) / tick - usage.ru_utime - usage.ru_stime
            wait = 0.0
            for task in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{task}/schedstat", encoding="ascii") as fh:
                        wait += int(fh.read().split()[1]) / 1e9
                except (OSError, IndexError):
                    continue  # a thread that ended between the listing and the read
        except (ImportError, OSError, IndexError, ValueError):
            return None
        return time.perf_counter(), steal / tick, others, wait

    def share(self, before: tuple[float, ...] | None,
              after: tuple[float, ...] | None) -> tuple[float, float, float] | None:
        """(wall s, the share of the CPU time withheld, the delay) between two readings, None if
        either is. The delay bounds what waiting for CPUs could add to the wall time: each second a
        thread of ours waited in the run queue (for whatever held the CPU, our own pools included)
        and each second of steal stalls the wall clock by at most a second, even where every thread
        waits at a barrier for the one descheduled. It takes the wait alone, read to the
        nanosecond, not its lesser with the others' CPU time: /proc/stat counts that in 10 ms ticks,
        too coarse for one block of calls."""
        if before is None or after is None or after[0] <= before[0]:
            return None
        wall = after[0] - before[0]
        steal, others, wait = (a - b for a, b in zip(after[1:], before[1:], strict=True))
        taken = min(wait / (wall * max(1, self.threads)), max(0.0, others) / (wall * self.cpus))
        delay = max(0.0, steal) + max(0.0, wait)
        return wall, max(0.0, steal / (wall * self.cpus) + taken), min(delay, wall)


def withheld(load: Sequence[PairLoad]) -> float | None:
    """The wall-weighted share of CPU time withheld over ``load``'s pairs (``HostLoad.share``)."""
    wall = sum(p.wall for p in load)
    return None if not load or wall <= 0 else sum(p.wall * p.share for p in load) / wall


def bandwidth_withheld(load: Sequence[PairLoad], quiet_gbps: float | None) -> float | None:
    """The wall-weighted share of the streaming bandwidth (``Bandwidth``) under ``quiet_gbps``, the
    session's quiet figure, over ``load``'s pairs; None where unprobed."""
    probed = [p for p in load if p.gbps is not None]
    wall = sum(p.wall for p in probed)
    if not probed or not quiet_gbps or wall <= 0:
        return None
    return sum(p.wall * max(0.0, 1.0 - p.gbps / quiet_gbps) for p in probed) / wall


def _farther(readings: list[float | None]) -> float | None:
    """The larger of a pair's placement or pace readings; None where either is missing."""
    return None if not readings or None in readings else max(readings)


def interleaved(timer: Timer, reference: Timed, impl: Timed, rounds: int, calls: tuple[int, int],
                first_round: int = 0, host: HostLoad | None = None,
                load: list[PairLoad] | None = None, warm: tuple[int, int] = (1, 1)) -> list[tuple[float, float]]:
    """(reference s, impl s) pairs from blocks timed in ABBA order (rounds count from
    ``first_round``): both blocks of a pair see the same host state, so their ratio does not move
    with it. A block is ``calls`` back-to-back calls after ``warm`` warming ones, read as the median
    call: each side runs with its own data in cache (evidence/from-the-code.md). With ``host``,
    each pair's ``PairLoad`` is appended to ``load``: the CPU time withheld around the pair, the
    delay around each side's timed calls alone, the bandwidth probed around the stretch, and the
    threads' placement and the core's pace read between pairs (the farther and the slower of the
    readings before and after it)."""
    pairs, loads = [], []
    gbps = [host.probe.read()] if host is not None and host.probe is not None else []
    placement = None if host is None else host.placement
    pace = None if host is None else host.pace
    placed: list[float | None] = []  # the round trip before each pair, and after the last
    paced: list[float | None] = []  # the pace before each pair, and after the last
    timed: list[tuple[float, ...] | None] = []  # host readings around the impl's timed calls
    reference_timed: list[tuple[float, ...] | None] = []  # and around the reference's

    def block(fn: Timed, n: int, warming: int, readings: list) -> float:
        warmed = (lambda: readings.append(host.read())) if host is not None else None
        times = timer.block(fn, n, warming, warmed)
        if host is not None:
            readings.append(host.read())
        return _median(times)

    def impl_block() -> float:
        return block(impl, calls[1], warm[1], timed)

    def reference_block() -> float:
        return block(reference, calls[0], warm[0], reference_timed)

    for i in range(first_round, first_round + rounds):
        if placement is not None:
            placed.append(placement.read())
        if pace is not None:
            paced.append(pace.read())
        before = host.read() if host is not None else None
        timed.clear()
        reference_timed.clear()
        if i % 2 == 0:  # ABBA: the reference first in even rounds
            pairs.append((reference_block(), impl_block()))
        else:
            o = impl_block()
            pairs.append((reference_block(), o))
        if host is not None:
            pair = host.share(before, host.read())
            own, ref = (host.share(*r) if len(r) == 2 else None for r in (timed, reference_timed))
            read = pair is not None and own is not None and ref is not None
            loads.append((pair[0], pair[1], own[2], ref[2]) if read else None)
    if gbps:
        gbps.append(host.probe.read())
    if placement is not None:
        placed.append(placement.read())
    if pace is not None:
        paced.append(pace.read())
    if load is not None:
        probe = sum(gbps) / len(gbps) if gbps else None
        load += [PairLoad(*stretch, gbps=probe, round_trip_ns=_farther(placed[k:k + 2]),
                          pace_ns=_farther(paced[k:k + 2]))
                 for k, stretch in enumerate(loads) if stretch is not None]
    return pairs
