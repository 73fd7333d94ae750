"""Where one call of ``per_sample_grads`` goes on the suite's MLP (784-256-256-10, B=64 by default):
the call with and without ``out=`` beside vmap(grad), the capture's parts (kernels.layer_capture),
a bare forward and backward, and the write of the result alone (the streamed first layer, and a
fill of the whole ``out=`` buffer), each a median of rounds interleaved in one process by
perfgate's timer for the device (on CUDA its events: a part the host's launches bound reads their
time).

    python -m evidence.per_sample_parts [threads, default 2] [cpu|cuda] [batch, default 64]
"""

import sys

from perfgate.timing import configure_malloc

malloc = configure_malloc("cache")  # the suite's mode, before any large allocation

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from evidence.ab import medians  # noqa: E402
from kernels import checks, nontemporal  # noqa: E402
from kernels import layer_capture as capture  # noqa: E402
from kernels import per_sample as ps  # noqa: E402
from perfgate.fingerprint import _cpu_model  # noqa: E402
from workloads.common import per_sample_problem, vmap_grads  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
args = per_sample_problem(batch, device)
model, _, x, y = args
buffers = kernels.per_sample_grads(*args)
names = ps.check_inputs(*args)
layers = ps._plan(model, names, "error").linear


def hooked(rows: int | None) -> object:
    """The probe's forwards (rows None) or the batch's, the layers' hooks on for it alone."""
    recorder = capture._Recorder(layers)
    try:
        return capture._probe_forward(model, x, recorder) if rows is None else recorder.run(model, x, rows)
    finally:
        recorder.remove()


probe = hooked(None)
out, seen = hooked(batch)
losses = capture.per_sample_losses(F.cross_entropy, out, y)
params = dict(model.named_parameters())
first = buffers["net.0.weight"]
g, a = torch.randn(batch, 256, 1, device=device), torch.randn(batch, 1, 784, device=device)
stream = device == "cpu" and nontemporal.pays(sum(t.numel() * t.element_size() for t in buffers.values()))


def forward_backward() -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


parts = {
    "per_sample_grads": lambda: kernels.per_sample_grads(*args),
    "per_sample_grads(out=)": lambda: kernels.per_sample_grads(*args, out=buffers),
    "vmap(grad)": lambda: vmap_grads(*args),
    "check_inputs": lambda: ps.check_inputs(*args),
    "  its finiteness check": lambda: checks.finite({"inputs": x, **{n: params[n] for n in names}}),
    "_plan": lambda: ps._plan(model, names, "error"),
    "capture (whole)": lambda: capture.capture(model, F.cross_entropy, x, y, layers),
    "  the probe's forward": lambda: hooked(None),
    "  the batch's forward, hooked": lambda: hooked(batch),
    "  the probe's comparison": lambda: capture._probe(probe, out, layers, seen),
    "  loss_parameters": lambda: capture.loss_parameters(losses, out, model),
    "  _used_outside": lambda: capture._used_outside(losses, layers, seen),
    "forward and backward, bare": forward_backward,
    f"first layer's outer product into out= ({'streamed' if stream else 'torch.mul'})":
        lambda: nontemporal.outer(g, a, first, stream=stream),
    "fill_ of the whole out= buffer": lambda: [t.fill_(1.0) for t in buffers.values()],
}
megabytes = sum(t.numel() * t.element_size() for t in buffers.values()) / 1e6
where = torch.cuda.get_device_name() if device == "cuda" else _cpu_model()
print(f"# {where}, {device}, {torch.get_num_threads()} thread(s), malloc {malloc}, torch {torch.__version__}; "
      f"MLP 784-256-256-10, B={batch}, the result {megabytes:.1f} MB")
for name, ms in medians(parts, rounds=15, calls=10, device=device).items():
    print(f"{name:60s} {ms:8.3f} ms")
