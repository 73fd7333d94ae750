"""per_sample_grads(out=) at batch B (default 64) against the write rate the host gives at that
moment: whether the call's share of the write limit (issue 32's 40% target) is set by the call or
by the host.

Each round times, back to back and in turn: a fill of the ``out=`` buffers (the rate the host
writes them at that moment: the fastest of torch's ``fill_``, libc's ``memset`` and streaming
stores (``perfgate._streamfill``, where built) from the session's threads, as perfgate's fill is
measured; the limit's write rate also counts a stream pass's written share, so it is no lower
than a fill's), ours with ``out=``, the Linear identity bare
(``evidence.per_sample_compile``: no check at all), a bare forward and backward (the arithmetic
every recipe does), and ``torch.compile(vmap(grad))``. Each row prints, per round, the call's GB/s
over the result's bytes and its share of the stored write limit, and the rounds are split at the
median fill rate: slow stretches against fast ones.

    python -m evidence.per_sample_write_rate [threads, default 2] [batch, default 64] [rounds, default 40]
"""

import concurrent.futures
import statistics
import sys
from pathlib import Path

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import round_times  # noqa: E402
from evidence.per_sample_compile import bare_identity  # noqa: E402
from perfgate.fingerprint import _cpu_model, fingerprint, slug  # noqa: E402
from perfgate.roofline import _libc_memset, _streamed_fill, page_blocks, read_limits, write_rate  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 40
if rounds < 2:
    sys.exit(f"rounds must be 2 or more (a slow and a fast half), got {rounds}")
torch.set_num_threads(threads)
args = per_sample_problem(batch)
model, _, x, y = args
buffers = kernels.per_sample_grads(*args)
bare_out = {n: torch.empty_like(t) for n, t in buffers.items()}
nbytes = sum(t.numel() * t.element_size() for t in buffers.values())
here = slug(fingerprint("cpu", threads, malloc))
stored = read_limits(Path(".benchmarks") / here / "limits.json", here)
limit = write_rate(stored)  # GB/s, the roofline column's write rate: a fill's, or a stream pass's written share
memset, streamed = _libc_memset(), _streamed_fill()
compiled = torch.compile(vmap_grads, dynamic=False)
compiled(*args)  # compiled outside the timing


pool = concurrent.futures.ThreadPoolExecutor(threads)
# each buffer cut into a block of whole pages a thread, as perfgate's fill is (ctypes lets go of the GIL)
spans = [span for t in buffers.values()
         for span in page_blocks(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), threads)]


def fill() -> None:
    """Every out= buffer written once by torch's fill_ (its intra-op threads)."""
    for t in buffers.values():
        t.fill_(0.5)


def fill_memset() -> None:
    """Every out= buffer written once by libc's memset, a block a thread."""
    list(pool.map(lambda span: memset(span[0], 0x3F, span[1] - span[0]), spans))


def fill_streamed() -> None:
    """Every out= buffer written once by streaming stores on torch's threads, a block each (whole
    64-byte lines: the buffers' sizes and addresses here are multiples of 64)."""
    for t in buffers.values():
        streamed(t.data_ptr(), t.numel() * t.element_size(), 0x3F, threads)


def forward_backward() -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


rows = {"fill_": fill, "memset": fill_memset, "streamed fill": fill_streamed,
        "ours out=": lambda: kernels.per_sample_grads(*args, out=buffers),
        "identity bare": lambda: bare_identity(model, x, y, bare_out), "forward+backward": forward_backward,
        "compile(vmap)": lambda: compiled(*args)}
if memset is None:
    del rows["memset"]
if streamed is None or any((t.data_ptr() | t.numel() * t.element_size()) % 64 for t in buffers.values()):
    del rows["streamed fill"]
FILLS = [name for name in ("fill_", "memset", "streamed fill") if name in rows]
# each row's median call a round: 3 calls after a warming one
seconds = {name: [statistics.median(block) for block in blocks]
           for name, blocks in round_times(rows, rounds, calls=3, warm=1).items()}
host = [nbytes / min(seconds[name][i] for name in FILLS) / 1e9 for i in range(rounds)]  # GB/s the host wrote at
cut = statistics.median(host)
slow = [i for i, r in enumerate(host) if r < cut]
fast = [i for i, r in enumerate(host) if r >= cut]


def share(ms: float) -> float:
    """A call of ``ms`` milliseconds as a percentage of the stored write limit: its roofline figure."""
    return 100 * nbytes / ms / 1e6 / limit


def line(name: str, ms: list[float]) -> str:
    """A row's median over all rounds, the slow half and the fast half, with their figures (none for
    the forward and backward, which write no result)."""
    whole, low, high = (statistics.median(ms[i] for i in idx) for idx in (range(rounds), slow, fast))
    writes = name != "forward+backward"
    rate, figures = (f"{nbytes / whole / 1e6:6.1f}", [f"{share(m):7.0f}%" for m in (whole, low, high)]) if writes \
        else (f"{'-':>6s}", [f"{'-':>8s}"] * 3)
    return f"{name:18s} {whole:15.3f} {rate} {figures[0]}   {low:14.3f} {figures[1]}   {high:14.3f} {figures[2]}"


print(f"# {_cpu_model()}, {threads} thread(s), malloc {malloc}, torch {torch.__version__}; MLP 784-256-256-10, "
      f"B={batch}, the result {nbytes / 1e6:.1f} MB; stored write limit {limit:.1f} GB/s ({here})")
print(f"# {rounds} rounds, each row the median of 3 calls; the host's rate that round: the fastest fill. Split at "
      f"its median, {cut:.1f} GB/s")
print(f"{'row':18s} {'all rounds: ms':>15s} {'GB/s':>6s} {'% limit':>8s}   {'slow half: ms':>14s} {'% limit':>8s}"
      f"   {'fast half: ms':>14s} {'% limit':>8s}")
for name in rows:
    print(line(name, [s * 1e3 for s in seconds[name]]))
print(line("the host's rate", [nbytes / r / 1e6 for r in host]))
shown = ("ours out=", "identity bare", "compile(vmap)")
of_host = [100 * nbytes / seconds["ours out="][i] / 1e9 / host[i] for i in range(rounds)]
print(f"# ours out= over the host's rate in the same round (the fastest fill's): median "
      f"{statistics.median(of_host):.0f}%, {min(of_host):.0f}-{max(of_host):.0f}%")
print(f"# per round, by the host's rate (GB/s): the share of the write limit of {', '.join(shown)}; ours' "
      "share of that round's rate")
for i in sorted(range(rounds), key=lambda i: host[i]):
    figures = " ".join(f"{share(seconds[k][i] * 1e3):5.0f}%" for k in shown)
    print(f"{host[i]:6.1f} {figures}   {of_host[i]:5.0f}%")
