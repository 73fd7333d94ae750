"""kernels.training.train == reference.training.train where they must agree; AMP within a band."""

from __future__ import annotations

import collections
import gc
import math
import time
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import reference.training as ref
from correctness_tests.conftest import requires_cuda
from correctness_tests.tolerances import REDUCTION, assert_close
from kernels.models import MLP
from kernels.training import Choice, Recipe, native_bf16, train


def _setup(seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MLP([8, width, 4])
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)


def _data(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable: the class is which quarter of the input is largest."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 8, generator=gen)
        out.append((x, x.reshape(size, 4, 2).sum(-1).argmax(-1)))
    return out


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fp32_loop_matches_reference() -> None:
    data = _data(6, 16)
    (m1, o1), (m2, o2) = _setup(), _setup()
    got, want = train(m1, F.cross_entropy, o1, data), ref.train(m2, F.cross_entropy, o2, data)
    assert got.optimizer_steps == want.optimizer_steps == 6 and got.skipped_steps == 0
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)


@pytest.mark.parametrize("scale", [1e20, 1e-30])
def test_fp64_losses_are_reported_in_fp64(scale: float) -> None:
    """A float64 model's losses past float32's range (2.5e40 here, or 2.5e-60) are reported as
    the reference reports them, not overflowed to inf (refused as a non-finite forward) or
    flushed to 0 (the review's case: the window kept its losses in float32)."""
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]], dtype=torch.float64) * scale
    y = torch.zeros(2, 1, dtype=torch.float64)
    models = [nn.Linear(2, 1, bias=False).double() for _ in range(2)]
    for m in models:
        with torch.no_grad():
            m.weight.fill_(1.0)
    got, want = (fn(m, F.mse_loss, torch.optim.SGD(m.parameters(), lr=0.0), [(x, y)])
                 for fn, m in zip((train, ref.train), models, strict=True))
    assert got.losses == want.losses == [pytest.approx(2.5 * scale**2, rel=1e-12)]


@given(k=st.integers(1, 4), micro=st.integers(1, 7), size=st.integers(1, 8))
def test_accumulation_equals_one_batch_per_window(k: int, micro: int, size: int) -> None:
    """k micro-batches of B/k (model without BatchNorm, mean loss) == one batch of B per step,
    the trailing partial window included (its gradient is that of its own mean)."""
    data = _data(micro, size)
    windows = [data[i : i + k] for i in range(0, micro, k)]
    merged = [(torch.cat([x for x, _ in w]), torch.cat([y for _, y in w])) for w in windows]
    (m1, o1), (m2, o2) = _setup(), _setup()
    got = train(m1, F.cross_entropy, o1, data, Recipe(accumulation=k))
    want = ref.train(m2, F.cross_entropy, o2, merged)
    assert got.optimizer_steps == len(windows)
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)


@given(k=st.integers(2, 4), sizes=st.lists(st.integers(1, 9), min_size=2, max_size=9))
def test_micro_batches_of_other_sizes_weigh_by_their_samples(k: int, sizes: list[int]) -> None:
    """A DataLoader without drop_last ends on a smaller micro-batch: each window's step equals
    the reference's on the window's samples merged (a mean over samples, not over micro-batches),
    its loss too."""
    gen = torch.Generator().manual_seed(3)
    data = []
    for n in sizes:
        x = torch.randn(n, 8, generator=gen)
        data.append((x, x.reshape(n, 4, 2).sum(-1).argmax(-1)))
    windows = [data[i : i + k] for i in range(0, len(data), k)]
    merged = [(torch.cat([x for x, _ in w]), torch.cat([y for _, y in w])) for w in windows]
    (m1, o1), (m2, o2) = _setup(), _setup()
    got = train(m1, F.cross_entropy, o1, data, Recipe(accumulation=k))
    want = ref.train(m2, F.cross_entropy, o2, merged)
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)


def test_recipe_auto_leaves_the_callers_random_streams_as_they_were() -> None:
    """Timing the candidates runs steps (dropout masks among them, and a loss that draws from
    Python's and NumPy's generators): a seeded run must draw the same numbers after Recipe.auto as
    without it."""
    import random

    import numpy as np

    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    batch = _data(1, 16)[0]

    def drawing(out: Tensor, y: Tensor) -> Tensor:  # e.g. label smoothing drawn per step
        return F.cross_entropy(out, y) + 0.0 * (random.random() + np.random.rand())

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    Recipe.auto("cpu", model=model, loss_fn=drawing, batch=batch)
    after = (torch.rand(3).tolist(), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert after == (torch.rand(3).tolist(), random.random(), np.random.rand())


@pytest.mark.parametrize("recipe", [Recipe(autocast_dtype=torch.bfloat16),
                                    Recipe(autocast_dtype=torch.float16, grad_scaler=True)],
                         ids=["bf16", "fp16+scaler"])
def test_amp_stays_in_a_band_of_fp32(recipe: Recipe) -> None:
    """Documented band: over 40 steps each AMP loss is within 0.03 + 3% of the fp32 loss, and
    both curves fall (the model learns under either)."""
    data = _data(40, 32)
    (m1, o1), (m2, o2) = _setup(width=32), _setup(width=32)
    fp32 = train(m1, F.cross_entropy, o1, data).losses
    bf16 = train(m2, F.cross_entropy, o2, data, recipe).losses
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a - b) <= 0.03 + 0.03 * b, (a, b)
    assert sum(fp32[-5:]) < 0.7 * sum(fp32[:5]) and sum(bf16[-5:]) < 0.7 * sum(bf16[:5])


def _poison(x: torch.Tensor, value: float = float("inf")) -> torch.Tensor:
    """One overflowed activation (inf): its loss and gradients are not finite."""
    x = x.clone()
    x[0, 0] = value
    return x


def _overflow(x: torch.Tensor, autocast: torch.dtype | None) -> torch.Tensor:
    """One large input: the loss stays finite and its gradients too, but times the GradScaler's
    2^16 they overflow (fp32 past 3.4e38 at 1e36, fp16 past 65504 at 1e3): the scaler's case."""
    return _poison(x, 1e3 if autocast == torch.float16 else 1e36)


@pytest.mark.parametrize("autocast", [None, torch.float16], ids=["fp32", "fp16"])
def test_overflowed_steps_are_skipped_never_applied(autocast: torch.dtype | None) -> None:
    """A batch whose gradients overflow is skipped: the parameters end exactly where a run
    without that batch ends, and the scheduler steps only for applied steps."""
    data = _data(4, 8)
    bad = [data[0], data[1], (_overflow(data[2][0], autocast), data[2][1]), data[3]]
    (m1, o1), (m2, o2) = _setup(), _setup()
    calls = []
    sched = torch.optim.lr_scheduler.LambdaLR(o1, lambda step: calls.append(step) or 1.0)
    calls.clear()  # LambdaLR evaluates once when built
    recipe = Recipe(autocast_dtype=autocast, grad_scaler=True)
    with pytest.warns(RuntimeWarning, match="1 of 4 optimizer steps were skipped"):
        result = train(m1, F.cross_entropy, o1, bad, recipe, scheduler=sched)
    clean = train(m2, F.cross_entropy, o2, [data[0], data[1], data[3]], recipe)
    assert math.isfinite(result.losses[2])  # the forward was fine: the scaled gradients overflowed
    assert result.optimizer_steps == 4 and result.skipped_steps == 1 and clean.skipped_steps == 0
    assert len(calls) == 3
    if autocast is None:  # scales are powers of two: exact
        torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)
    else:  # fp16 gradients at another scale round differently
        assert_close(_params(m1), _params(m2), REDUCTION, dtype=torch.float16)


def test_overflow_without_a_scaler_is_an_error_before_the_step() -> None:
    data = _data(3, 8)
    data[1] = (_poison(data[1][0]), data[1][1])
    (m1, o1), (m2, o2) = _setup(), _setup()
    with pytest.raises(FloatingPointError, match="not finite at optimizer step 2; the step was not applied"):
        train(m1, F.cross_entropy, o1, data)
    train(m2, F.cross_entropy, o2, data[:1])
    torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(grad_scaler=True), Recipe(torch.float16, grad_scaler=True),
                                    Recipe(grad_scaler=True, accumulation=2)],
                         ids=["fp32", "scaler", "fp16+scaler", "scaler+acc2"])
def test_a_nan_in_the_data_is_an_error_before_its_step(recipe: Recipe) -> None:
    """A NaN input makes the loss NaN: an error before that step under every recipe, the
    parameters where the clean batches before it left them, not a batch a GradScaler skips
    silently (the scaler rescales gradients; it cannot fix a NaN forward)."""
    k = recipe.accumulation
    data = _data(3 * k, 8)
    data[k] = (_poison(data[k][0], float("nan")), data[k][1])  # the second optimizer step's first micro-batch
    (m1, o1), (m2, o2) = _setup(), _setup()
    with pytest.raises(FloatingPointError, match="loss nan is not finite at optimizer step 2; the step was not "
                                                 "applied.* Check the batch for NaN or inf"):
        train(m1, F.cross_entropy, o1, data, recipe)
    train(m2, F.cross_entropy, o2, data[:k], recipe)
    torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)


def _nan_gradients(every: int = 1) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy plus sqrt(0 * out), which adds 0 to the loss and NaN to every gradient
    (0 * 1/sqrt(0)): on every ``every``-th call, from the first."""
    calls = iter(range(10**6))

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        loss = F.cross_entropy(out, y)
        return loss + out.mul(0).sqrt().sum() if next(calls) % every == 0 else loss

    return loss_fn


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(accumulation=2)], ids=["fp32", "acc2"])
def test_nan_gradients_under_a_finite_loss_are_an_error_without_a_scaler(recipe: Recipe) -> None:
    """No GradScaler to skip the step: NaN gradients under a finite loss raise before the step,
    the parameters where the first step left them."""
    k = recipe.accumulation
    (m1, o1), (m2, o2) = _setup(), _setup()
    data = _data(3 * k, 8)
    train(m2, F.cross_entropy, o2, data[:k], recipe)
    calls = iter(range(10**6))

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:  # clean for the first step's micro-batches, then NaN gradients
        return F.cross_entropy(out, y) if next(calls) < k else _nan_gradients()(out, y)

    with pytest.raises(FloatingPointError, match=r"the gradients of loss \S+ are not finite at optimizer step 2; "
                                                 "the step was not applied"):
        train(m1, loss_fn, o1, data, recipe)
    torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)


def test_a_transient_overflow_in_a_long_run_is_warned_not_raised() -> None:
    """One overflowing batch in 40 fp16 steps: skipped, the scale backed off once, the run goes
    on (no error), and a warning says how many steps of how many were skipped."""
    data = _data(40, 16)
    data[20] = (_overflow(data[20][0], torch.float16), data[20][1])
    model, opt = _setup(width=32)
    with pytest.warns(RuntimeWarning, match="1 of 40 optimizer steps were skipped") as caught:
        result = train(model, F.cross_entropy, opt, data, Recipe(torch.float16, grad_scaler=True))
    assert result.optimizer_steps == 40 and result.skipped_steps == 1 and all(map(math.isfinite, result.losses))
    assert "pass the same scaler=" in str(caught[0].message)  # a fresh scaler each call re-learns its scale
    assert sum(result.losses[-5:]) < 0.7 * sum(result.losses[:5])  # and the model still learned


@pytest.mark.parametrize(("every", "min_scale", "raised_at", "skips"),
                         [(1, None, 17, 17), (1, 2.0**12, 5, 5), (2, None, 33, 17)],
                         ids=["every-step", "min_grad_scale", "every-other-step"])
def test_gradients_that_stay_nan_raise_once_the_scale_is_useless(every: int, min_scale: float | None,
                                                                 raised_at: int, skips: int) -> None:
    """NaN gradients under a finite loss, on every step or every other one: the GradScaler
    halves its 2^16 scale per skip (clean steps grow it back only after 2000 in a row), and the
    skip that takes it below min_grad_scale (default 1: the 17th) raises instead of skipping on
    forever. min_grad_scale=0 never raises: every step is skipped, and warned."""
    recipe = Recipe(grad_scaler=True, **({"min_grad_scale": min_scale} if min_scale is not None else {}))
    model, opt = _setup()
    before = _params(model)
    with pytest.raises(FloatingPointError, match=rf"skipped optimizer step {raised_at} \({skips} of {raised_at} "
                                                 r"in this call\).* below min_grad_scale"):
        train(model, _nan_gradients(every), opt, _data(40, 8), recipe)
    if every == 1:
        assert torch.equal(_params(model), before)  # no step was applied
    model, opt = _setup()
    with pytest.warns(RuntimeWarning, match="20 of 20 optimizer steps were skipped"):
        result = train(model, _nan_gradients(), opt, _data(20, 8), Recipe(grad_scaler=True, min_grad_scale=0))
    assert result.skipped_steps == 20 and torch.equal(_params(model), before)


def test_an_optimizer_that_does_not_train_the_model_is_refused() -> None:
    model, _ = _setup()
    other, other_opt = _setup()  # the same architecture: only the parameters' identity tells them apart
    with pytest.raises(ValueError, match="the optimizer holds 4 of its 4 parameters that are not the model's"):
        train(model, F.cross_entropy, other_opt, _data(1, 4))
    mixed = torch.optim.SGD([*model.parameters(), next(other.parameters())], lr=0.1)
    with pytest.raises(ValueError, match="holds 1 of its 5 parameters that are not the model's"):
        train(model, F.cross_entropy, mixed, _data(1, 4))
    frozen = torch.optim.SGD(model.parameters(), lr=0.1)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no trainable parameters"):
        train(model, F.cross_entropy, frozen, _data(1, 4))
    model.requires_grad_(True)
    head = list(model.parameters())[-2:]
    for p in head:
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="holds none of the model's 2 trainable parameters, only frozen ones"):
        train(model, F.cross_entropy, torch.optim.SGD(head, lr=0.1), _data(1, 4))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        train(model, F.cross_entropy, list(model.parameters()), _data(1, 4))


def test_an_optimizer_over_part_of_the_model_is_warned_and_trains_that_part() -> None:
    """Trainable parameters left out of the optimizer: a warning (their gradients are computed and
    accumulate); parameters frozen by requires_grad=False and left out: silent. Both train the rest."""
    import warnings

    model, _ = _setup()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    before = [p.detach().clone() for p in first]
    with pytest.warns(UserWarning, match=r"2 of the trainable parameters \(.*\) are not in the optimizer"):
        train(model, F.cross_entropy, torch.optim.SGD(rest, lr=0.1), _data(2, 4))
    assert all(torch.equal(p, b) for p, b in zip(first, before, strict=True))
    for p in first:
        p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train(model, F.cross_entropy, torch.optim.SGD(rest, lr=0.1), _data(2, 4))
    assert result.optimizer_steps == 2


def test_wrapped_models_and_loss_modules_own_their_parameters() -> None:
    """torch.compile's wrapper and DDP (tested under torchrun in test_distributed.py) hold the
    module's own parameters; a loss_fn that is an nn.Module may train parameters of its own."""
    import warnings

    from kernels.training import check_parameters

    model, opt = _setup()
    assert len(check_parameters(torch.compile(model), F.cross_entropy, opt)) == 4  # nothing compiles here

    class Tempered(nn.Module):  # a learnable temperature
        def __init__(self) -> None:
            super().__init__()
            self.log_t = nn.Parameter(torch.zeros(()))

        def forward(self, out: Tensor, y: Tensor) -> Tensor:
            return F.cross_entropy(out / self.log_t.exp(), y)

    loss_fn = Tempered()
    opt = torch.optim.SGD([*model.parameters(), loss_fn.log_t], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, loss_fn, opt, _data(2, 4))
    assert loss_fn.log_t.item() != 0.0
    # the temperature left out of the optimizer: its gradient would pile up unseen, as a model's would
    with pytest.warns(UserWarning, match=r"1 of the trainable parameters \(the model's, and loss_fn's"):
        train(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), _data(2, 4))


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_read_after_the_step_before_it(k: int) -> None:
    """A batch generator may depend on the model's state (OCS selects its next batch with the
    model as the last step left it): the engine never reads a batch ahead of its step."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Tensor] = []

    def batches() -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(4):
            seen.append(model.weight.detach().clone())
            yield torch.ones(2, 3), torch.zeros(2, 1)

    train(model, F.mse_loss, opt, batches(), Recipe(accumulation=k))
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:], strict=False)]
    assert changed == [i % k == k - 1 for i in range(3)], changed  # the weight moved exactly after each step


def test_one_cycle_scheduler_steps_once_per_optimizer_step() -> None:
    data = _data(12, 8)
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    result = train(model, F.cross_entropy, opt, data, Recipe(accumulation=3), scheduler=sched)
    assert result.optimizer_steps == 4 and sched.last_epoch == 4


def test_one_cycle_with_accumulation_matches_the_reference_on_merged_batches() -> None:
    """AdamW-free but the same shape as the CIFAR workload's OneCycleLR row: k micro-batches per
    step under OneCycleLR == the reference loop on the merged batches with its own OneCycleLR."""
    data, k = _data(12, 8), 3
    merged = [(torch.cat([x for x, _ in data[i : i + k]]), torch.cat([y for _, y in data[i : i + k]]))
              for i in range(0, 12, k)]
    (m1, o1), (m2, o2) = _setup(), _setup()
    s1, s2 = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=4) for o in (o1, o2))
    got = train(m1, F.cross_entropy, o1, data, Recipe(accumulation=k), scheduler=s1)
    want = ref.train(m2, F.cross_entropy, o2, merged, scheduler=s2)
    assert got.optimizer_steps == want.optimizer_steps == 4 and s1.get_last_lr() == s2.get_last_lr()
    assert_close(_params(m1), _params(m2), REDUCTION)


def test_channels_last_matches_fp32() -> None:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    import copy

    other = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, foreach=False)  # noqa: E731
    got = train(net, F.cross_entropy, sgd(net), data, Recipe(channels_last=True))
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)  # converted in place, as documented
    want = ref.train(other, F.cross_entropy, sgd(other), data)
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    assert_close(_params(net), _params(other), REDUCTION)


def test_channels_last_leaves_batches_of_other_ranks_as_they_are() -> None:
    """Recipe.auto picks channels_last on CUDA for any model it is not given to time: an MLP's
    (B, D) batches train under it exactly as without it (only 4-d inputs have a channels_last layout)."""
    (m1, o1), (m2, o2) = _setup(), _setup()
    data = _data(2, 8)
    train(m1, F.cross_entropy, o1, data, Recipe(channels_last=True))
    train(m2, F.cross_entropy, o2, data)
    torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)


def test_a_compile_mode_compiles_the_forward(monkeypatch) -> None:
    """The recipe's compile_mode reaches torch.compile (results alone cannot tell: the compiled
    forward computes what eager does)."""
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or model)
    model, opt = _setup()
    train(model, F.cross_entropy, opt, _data(1, 8), Recipe(compile_mode="max-autotune"))
    train(model, F.cross_entropy, opt, _data(1, 8))
    assert modes == ["max-autotune"]


def test_train_starts_in_train_mode_from_zero_gradients() -> None:
    """A model left in eval mode trains with its dropout live, and gradients left in .grad by the
    caller (a backward of their own) do not enter the first step: the run equals a fresh one."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = MLP([8, 16, 4], dropout=0.5)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    data = _data(3, 8)
    (m1, o1), (m2, o2) = build(), build()
    m1.eval()
    for p in m1.parameters():
        p.grad = torch.ones_like(p)
    torch.manual_seed(1)
    got = train(m1, F.cross_entropy, o1, data)
    torch.manual_seed(1)
    want = train(m2, F.cross_entropy, o2, data)
    assert m1.training and got.losses == want.losses
    torch.testing.assert_close(_params(m1), _params(m2), atol=0, rtol=0)


def test_recipe_auto() -> None:
    assert Recipe.auto("cpu") == Recipe()  # nothing to measure on: plain fp32
    cuda = Recipe.auto("cuda", accumulation=2)
    assert (cuda.autocast_dtype, cuda.grad_scaler, cuda.accumulation) == (torch.float16, True, 2)
    model, _ = _setup()
    x, y = _data(1, 16)[0]
    chosen = Recipe.choose("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    # channels_last only for images; bf16 only where the CPU computes it (this one, or not)
    assert set(chosen.step_ms) == ({"fp32", "bfloat16"} if native_bf16("cpu") else {"fp32"})
    # a GPU's bf16 is its own hardware's from compute capability 8.0; one this process cannot query: measured
    assert native_bf16("cuda") == (not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8)
    assert all(0 < ms < 1e4 for ms in chosen.step_ms.values()) and chosen.compile_s == {}
    assert chosen.recipe.name in chosen.step_ms and Recipe.choose("cpu") == Choice(Recipe())
    assert _params(model).equal(_params(_setup()[0]))  # timed on a copy: the model is untouched


def test_a_scaler_passed_in_keeps_its_scale_across_calls() -> None:
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    recipe = Recipe(grad_scaler=True)
    train(model, F.cross_entropy, opt, _data(2, 8), recipe, scaler=scaler)
    assert scaler.get_scale() == 2.0**9  # grew after 2 clean steps
    train(model, F.cross_entropy, opt, _data(2, 8, seed=5), recipe, scaler=scaler)
    assert scaler.get_scale() == 2.0**10  # and again: not reset by the second call
    with pytest.raises(ValueError, match="grad_scaler is False"):
        train(model, F.cross_entropy, opt, _data(1, 8), Recipe(), scaler=scaler)


def test_bad_recipes_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="accumulation"):
        Recipe(accumulation=0)
    with pytest.raises(ValueError, match="grad_scaler"):
        Recipe(autocast_dtype=torch.float16)
    with pytest.raises(ValueError, match="autocast_dtype"):
        Recipe(autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="compile_mode"):
        Recipe(compile_mode="fast")
    model, opt = _setup()
    with pytest.raises(ValueError, match="scalar"):
        train(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), opt, _data(1, 4))
    x, y = _data(1, 4)[0]
    with pytest.raises(TypeError, match="batches must yield \\(inputs, targets\\) pairs; batch 0 is a tuple of 3"):
        train(model, F.cross_entropy, opt, [(x, y, y)])
    with pytest.raises(ValueError, match="plain fp32"):
        ref.train(model, F.cross_entropy, opt, _data(1, 4), Recipe(accumulation=2))


def test_recipe_fields_are_refused_by_type() -> None:
    """bool is an int, so accumulation=True must be refused, not read as 1; flags must be bools, not
    0/1 or strings."""
    import numpy as np

    with pytest.raises(ValueError, match="accumulation must be an int >= 1, got bool True"):
        Recipe(accumulation=True)
    with pytest.raises(TypeError, match="grad_scaler must be True or False, got int 1"):
        Recipe(grad_scaler=1)
    with pytest.raises(TypeError, match="channels_last must be True or False, got str 'yes'"):
        Recipe(channels_last="yes")
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ValueError, match="min_grad_scale must be a finite number >= 0"):
            Recipe(grad_scaler=True, min_grad_scale=bad)
    assert Recipe(accumulation=np.int64(2)) == Recipe(accumulation=2)  # stored as an int
    model, opt = _setup()
    with pytest.raises(TypeError, match="recipe must be a kernels.Recipe"):
        train(model, F.cross_entropy, opt, _data(1, 4), {"accumulation": 2})


@pytest.mark.parametrize(("bf16_ms", "chosen"), [(9.5, None), (9.0, torch.bfloat16), (8.5, torch.bfloat16)])
def test_recipe_auto_leaves_fp32_only_for_a_clear_win(monkeypatch, bf16_ms: float, chosen) -> None:
    """A candidate within AUTO_MARGIN (10%) of fp32 is timing noise, not worth lower precision;
    one exactly 10% faster is "at least 10% faster"."""
    import kernels.training as engine

    timed = {"fp32": 10.0, "bfloat16": bf16_ms}
    monkeypatch.setattr(engine, "_time_steps", lambda recipes, *a, **k: {r.name: timed[r.name] for r in recipes})
    monkeypatch.setattr(engine, "native_bf16", lambda device: True)  # a CPU with bf16 instructions
    model, _ = _setup()
    x, y = _data(1, 16)[0]
    choice = Recipe.choose("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert choice.recipe.autocast_dtype is chosen and choice.step_ms == timed
    assert Recipe.auto("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y)) == choice.recipe


def test_recipe_auto_times_its_candidates_interleaved(monkeypatch) -> None:
    """Each candidate trains on its own copy of the model (the caller's untouched), a warm-up step
    each, then rounds of one step of each in an order rotated every round; each median is of its
    own steps."""
    import kernels.training as engine

    calls: list[tuple[str, int]] = []
    sleep = {"fp32": 0.002, "fp32+channels_last": 0.006}

    def fake_train(model, loss_fn, opt, data, recipe, device=None):
        calls.append((recipe.name, id(model)))
        time.sleep(sleep[recipe.name])

    monkeypatch.setattr(engine, "train", fake_train)
    model, _ = _setup()
    recipes = [Recipe(), Recipe(channels_last=True)]
    ms = engine._time_steps(recipes, model, F.cross_entropy, _data(1, 4)[0], "cpu")
    names = [name for name, _ in calls]
    assert names[:2] == ["fp32", "fp32+channels_last"]  # the warm-ups
    rounds = [names[i:i + 2] for i in range(2, len(names), 2)]
    assert len(rounds) >= engine.MIN_ROUNDS and rounds[0] == ["fp32", "fp32+channels_last"]
    assert rounds[1] == ["fp32+channels_last", "fp32"] and rounds[2] == rounds[0]  # rotated
    models = {name: {m for n, m in calls if n == name} for name in sleep}
    assert all(len(m) == 1 for m in models.values()) and not models["fp32"] & models["fp32+channels_last"]
    assert id(model) not in models["fp32"] | models["fp32+channels_last"]
    assert 1.5 < ms["fp32"] < 5.0 < ms["fp32+channels_last"]


def test_recipe_auto_times_no_emulated_bf16(monkeypatch) -> None:
    """Where bf16 runs in software (no AVX512-BF16 or AMX) auto times fp32 and channels_last only,
    and keeps channels_last when it clears the margin; with the instructions it times all four."""
    import kernels.training as engine

    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 2, (4,))
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(72, 2))
    timed = {"fp32": 10.0, "fp32+channels_last": 8.5, "bfloat16": 1.0, "bfloat16+channels_last": 1.0}
    monkeypatch.setattr(engine, "_time_steps", lambda recipes, *a, **k: {r.name: timed[r.name] for r in recipes})
    monkeypatch.setattr(engine, "native_bf16", lambda device: False)
    choice = Recipe.choose("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert choice.step_ms == {"fp32": 10.0, "fp32+channels_last": 8.5} and choice.recipe.channels_last
    assert choice.recipe.autocast_dtype is None
    monkeypatch.setattr(engine, "native_bf16", lambda device: True)
    choice = Recipe.choose("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert choice.step_ms == timed and choice.recipe.autocast_dtype is torch.bfloat16


def test_recipe_auto_times_fp16_and_bf16_on_cuda(monkeypatch) -> None:
    """Given the model and batch, auto on CUDA times fp32, fp16 (with its GradScaler) and bf16
    where the GPU computes it, channels_last too for images, and leaves fp32 only for a clear win;
    without them it takes fp16 + GradScaler + channels_last unmeasured."""
    import kernels.training as engine

    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 2, (4,))
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(72, 2))
    timed = {"fp32": 10.0, "float16": 9.5, "bfloat16": 9.6, "fp32+channels_last": 10.2,
             "float16+channels_last": 9.4, "bfloat16+channels_last": 9.7}
    seen: list[Recipe] = []
    monkeypatch.setattr(engine, "_time_steps",
                        lambda recipes, *a, **k: seen.extend(recipes) or {r.name: timed[r.name] for r in recipes})
    monkeypatch.setattr(engine, "native_bf16", lambda device: True)  # an Ampere or later GPU
    choice = Recipe.choose("cuda", accumulation=2, model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert choice.step_ms == timed and choice.recipe == Recipe(accumulation=2)  # no candidate 10% faster
    assert all(r.grad_scaler == (r.autocast_dtype == torch.float16) for r in seen)
    timed["float16+channels_last"] = 8.0
    choice = Recipe.choose("cuda", accumulation=2, model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert choice.recipe == Recipe(torch.float16, True, 2, channels_last=True)
    monkeypatch.setattr(engine, "native_bf16", lambda device: False)  # an older GPU emulates bf16
    choice = Recipe.choose("cuda", model=model[1:], loss_fn=F.cross_entropy, batch=(x.flatten(1)[:, :72], y))
    assert set(choice.step_ms) == {"fp32", "float16"}  # no images: no channels_last
    assert Recipe.choose("cuda") == Choice(Recipe(torch.float16, True, channels_last=True))


@requires_cuda
def test_recipe_auto_times_every_candidate_on_a_gpu() -> None:
    """On a GPU, each candidate trains for real on a copy: fp16 under its GradScaler, bf16 where
    the GPU computes it, channels_last for images; the model and the random streams are left
    as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).cuda()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 3, 8, 8, device="cuda"), torch.randint(0, 2, (8,), device="cuda")
    state = torch.cuda.get_rng_state()
    choice = Recipe.choose("cuda", accumulation=2, model=model, loss_fn=F.cross_entropy, batch=(x, y))
    dtypes = {"fp32", "float16"} | ({"bfloat16"} if torch.cuda.get_device_capability()[0] >= 8 else set())
    assert set(choice.step_ms) == dtypes | {f"{d}+channels_last" for d in dtypes}
    assert all(0 < ms < 1e4 for ms in choice.step_ms.values()) and choice.recipe.accumulation == 2
    assert choice.recipe.name in choice.step_ms and torch.cuda.get_rng_state().equal(state)
    assert all(p.equal(b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(("compiled_ms", "kept"), [(9.5, None), (9.0, "max-autotune"), (8.5, "max-autotune")])
def test_recipe_auto_keeps_a_compile_mode_only_when_it_measures_faster(monkeypatch, compiled_ms: float,
                                                                       kept: str | None) -> None:
    import kernels.training as engine

    timed = {"fp32": 10.0, "bfloat16": 12.0, "fp32+compile": 9.8, "fp32+compile:max-autotune": compiled_ms}
    groups = []

    def fake(recipes, *a, first_s=None, **k):
        groups.append([recipe.name for recipe in recipes])
        for recipe in recipes:
            if first_s is not None:  # the compile, reported apart: 30 s default, 45 s max-autotune
                first_s.append({None: 0.01, "default": 30.0}.get(recipe.compile_mode, 45.0))
        # fp32 read 11 ms among the eager candidates, 10 ms beside the compiled ones: the latter stands
        return {recipe.name: 11.0 if recipe.name == "fp32" and len(groups) == 1 else timed[recipe.name]
                for recipe in recipes}

    monkeypatch.setattr(engine, "_time_steps", fake)
    monkeypatch.setattr(engine, "native_bf16", lambda device: True)
    model, _ = _setup()
    x, y = _data(1, 16)[0]
    choice = Recipe.choose("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y),
                           compile_modes=("default", "max-autotune"))
    assert choice.recipe.compile_mode == kept and choice.recipe.autocast_dtype is None
    assert choice.step_ms == timed
    assert choice.compile_s == {"fp32+compile": 30.0, "fp32+compile:max-autotune": 45.0}
    # the eager candidates in one group, then eager's pick and every compiled one interleaved in another
    assert groups == [["fp32", "bfloat16"], ["fp32", "fp32+compile", "fp32+compile:max-autotune"]]
    with pytest.raises(ValueError, match="compile_modes must be among"):
        Recipe.auto("cpu", compile_modes=("fast",))
    assert Recipe.choose("cpu", compile_modes=("default",)) == Choice(Recipe())  # nothing to time them on


def test_a_compiled_recipe_trains_as_the_reference_does() -> None:
    """torch.compile (default mode) through the engine: the fp32 run's losses and parameters
    within the table's tolerance of the reference loop's; its name says the mode."""
    (m1, o1), (m2, o2) = _setup(), _setup()
    data = _data(3, 16)
    eager = ref.train(m1, F.cross_entropy, o1, data)
    compiled = train(m2, F.cross_entropy, o2, data, Recipe(compile_mode="default"))
    assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), REDUCTION)
    assert_close(_params(m2), _params(m1), REDUCTION)
    assert Recipe(compile_mode="default").name == "fp32+compile"
    assert Recipe(compile_mode="reduce-overhead").name == "fp32+compile:reduce-overhead"


# Gradient clipping by global norm. MAX_NORM binds on these data: the first steps' gradient
# norms are 0.3-0.6 (the tests check that clipping changed the run, so they cannot pass vacuously).
MAX_NORM = 0.05


def test_clipping_matches_the_reference_and_binds() -> None:
    data = _data(6, 16)
    (m1, o1), (m2, o2), (m3, o3) = _setup(), _setup(), _setup()
    got = train(m1, F.cross_entropy, o1, data, max_grad_norm=MAX_NORM)
    want = ref.train(m2, F.cross_entropy, o2, data, max_grad_norm=MAX_NORM)
    train(m3, F.cross_entropy, o3, data)
    assert len(got.grad_norms) == len(want.grad_norms) == 6 and min(want.grad_norms) > MAX_NORM
    assert_close(torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)
    assert not torch.allclose(_params(m1), _params(m3), rtol=1e-3, atol=1e-4)  # clipping changed the run


@given(k=st.integers(2, 4), micro=st.integers(2, 7), size=st.integers(1, 8))
def test_clipping_acts_once_per_step_on_the_accumulated_gradient(k: int, micro: int, size: int) -> None:
    """k micro-batches clipped once per window == one batch of B clipped once per step (the
    trailing partial window included); clipping each micro-batch would differ."""
    data = _data(micro, size)
    windows = [data[i : i + k] for i in range(0, micro, k)]
    merged = [(torch.cat([x for x, _ in w]), torch.cat([y for _, y in w])) for w in windows]
    (m1, o1), (m2, o2) = _setup(), _setup()
    got = train(m1, F.cross_entropy, o1, data, Recipe(accumulation=k), max_grad_norm=MAX_NORM)
    want = ref.train(m2, F.cross_entropy, o2, merged, max_grad_norm=MAX_NORM)
    assert len(got.grad_norms) == len(windows)
    assert_close(torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)


def test_clipping_unscales_first_under_a_grad_scaler() -> None:
    """Under GradScaler (fp32 autocast off, so the only difference is the scale of 2^16) the
    clipped run equals the unscaled one: clipping the scaled gradient would shrink every step
    2^16-fold. A step whose gradients overflow is still skipped, its norm reported as inf."""
    data = _data(4, 8)
    (m1, o1), (m2, o2) = _setup(), _setup()
    got = train(m1, F.cross_entropy, o1, data, Recipe(grad_scaler=True), max_grad_norm=MAX_NORM)
    want = train(m2, F.cross_entropy, o2, data, max_grad_norm=MAX_NORM)
    assert_close(torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), REDUCTION)
    assert_close(_params(m1), _params(m2), REDUCTION)
    bad = [data[0], (_overflow(data[1][0], None), data[1][1])]
    (m3, o3), (m4, o4) = _setup(), _setup()
    with pytest.warns(RuntimeWarning, match="1 of 2 optimizer steps were skipped"):
        result = train(m3, F.cross_entropy, o3, bad, Recipe(grad_scaler=True), max_grad_norm=MAX_NORM)
    train(m4, F.cross_entropy, o4, bad[:1], Recipe(grad_scaler=True), max_grad_norm=MAX_NORM)
    assert result.skipped_steps == 1 and not math.isfinite(result.grad_norms[1])
    torch.testing.assert_close(_params(m3), _params(m4), atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1.0", True])
def test_bad_max_grad_norm_is_refused(bad) -> None:
    model, opt = _setup()
    for loop in (train, ref.train):
        with pytest.raises(ValueError, match=r"max_grad_norm \(None: no clipping\) must be a finite number > 0"):
            loop(model, F.cross_entropy, opt, _data(1, 4), max_grad_norm=bad)


# Checkpoint and resume: N steps == N/2 steps, save, fresh objects, load, N/2 steps, bitwise.
def _resumable(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Dropout (the torch RNG), AdamW (tensor and plain state), OneCycleLR (plain state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8)


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(grad_scaler=True, accumulation=2)],
                         ids=["fp32", "scaler+acc2"])
def test_resume_from_a_checkpoint_continues_the_run_bitwise(tmp_path, recipe: Recipe) -> None:
    import random

    import numpy as np

    from kernels.training import load_checkpoint, save_checkpoint

    def seed(n: int) -> None:
        torch.manual_seed(n)
        random.seed(n)
        np.random.seed(n)

    data = _data(8 * recipe.accumulation, 8)
    half = 4 * recipe.accumulation
    model, opt, sched = _resumable(0)
    scaler = torch.amp.GradScaler("cpu") if recipe.grad_scaler else None
    seed(123)
    whole = train(model, F.cross_entropy, opt, data, recipe, scheduler=sched, scaler=scaler)
    draws = (torch.rand(3), random.random(), np.random.rand())

    model2, opt2, sched2 = _resumable(0)
    scaler2 = torch.amp.GradScaler("cpu") if recipe.grad_scaler else None
    seed(123)
    first = train(model2, F.cross_entropy, opt2, data[:half], recipe, scheduler=sched2, scaler=scaler2)
    save_checkpoint(tmp_path / "ckpt.safetensors", model2, opt2, scheduler=sched2, scaler=scaler2, step=4)
    seed(999)  # the fresh process's own RNG states, which the checkpoint replaces
    model3, opt3, sched3 = _resumable(7)  # other initial weights: all of them come from the file
    scaler3 = torch.amp.GradScaler("cpu") if recipe.grad_scaler else None
    assert load_checkpoint(tmp_path / "ckpt.safetensors", model3, opt3, scheduler=sched3, scaler=scaler3) == 4
    assert opt3.state_dict()["param_groups"] == opt2.state_dict()["param_groups"]  # betas a tuple, not JSON's list
    rest = train(model3, F.cross_entropy, opt3, data[half:], recipe, scheduler=sched3, scaler=scaler3)
    torch.testing.assert_close(_params(model3), _params(model), atol=0, rtol=0)
    assert first.losses + rest.losses == whole.losses and sched3.get_last_lr() == sched.get_last_lr()
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (draws[0].tolist(), *draws[1:])
    if scaler is not None:
        assert scaler3.get_scale() == scaler.get_scale()


def test_a_resumed_multistep_scheduler_decays_where_the_run_would(tmp_path) -> None:
    """MultiStepLR keeps its milestones in a Counter keyed by epoch (int): JSON would make the
    keys strings, and the resumed run would never decay."""
    from kernels.training import load_checkpoint, save_checkpoint

    def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model, opt = _setup()
        return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.1)

    data = _data(6, 8)
    model, opt, sched = build()
    train(model, F.cross_entropy, opt, data, scheduler=sched)
    model2, opt2, sched2 = build()
    train(model2, F.cross_entropy, opt2, data[:1], scheduler=sched2)
    save_checkpoint(tmp_path / "ckpt.safetensors", model2, opt2, scheduler=sched2, step=1)
    model3, opt3, sched3 = build()
    load_checkpoint(tmp_path / "ckpt.safetensors", model3, opt3, scheduler=sched3)
    train(model3, F.cross_entropy, opt3, data[1:], scheduler=sched3)
    assert sched3.get_last_lr() == sched.get_last_lr() == [pytest.approx(0.1 * 0.01)]
    assert sched3.state_dict() == sched.state_dict()
    # a Counter again, not the dict JSON gives back: a step to an epoch reads its elements()
    assert type(sched3.milestones) is type(sched.milestones) is collections.Counter
    with pytest.warns(UserWarning, match="epoch parameter"):  # torch's deprecated step(epoch), still served
        sched.step(3), sched3.step(3)
    assert sched3.get_last_lr() == sched.get_last_lr()
    torch.testing.assert_close(_params(model3), _params(model), atol=0, rtol=0)


def test_a_resume_under_other_settings_is_refused_before_anything_loads(tmp_path) -> None:
    """settings= saved with a checkpoint hold a resume to the run's own (another batch or seed trains
    another run); a difference is named, and the objects keep their state."""
    from kernels.training import checkpoint_settings, load_checkpoint, save_checkpoint

    model, opt = _setup()
    ours = {"batch": 8, "seed": 0, "shape": (2, 3)}
    save_checkpoint(tmp_path / "c.safetensors", model, opt, step=3, settings=ours)
    assert checkpoint_settings(tmp_path / "c.safetensors") == {"batch": 8, "seed": 0, "shape": [2, 3]}
    fresh, fresh_opt = _setup(seed=1)
    before = _params(fresh)
    with pytest.raises(ValueError, match=r"other settings \(batch: saved 8, now 16\)"):
        load_checkpoint(tmp_path / "c.safetensors", fresh, fresh_opt, settings={**ours, "batch": 16})
    with pytest.raises(ValueError, match=r"other settings \(lr: saved None, now 0.1\)"):  # one not saved
        load_checkpoint(tmp_path / "c.safetensors", fresh, fresh_opt, settings={**ours, "lr": 0.1})
    assert torch.equal(_params(fresh), before)
    assert load_checkpoint(tmp_path / "c.safetensors", fresh, fresh_opt, settings=ours) == 3
    save_checkpoint(tmp_path / "bare.safetensors", model, opt, step=1)
    with pytest.raises(ValueError, match="saved without its run's settings"):
        load_checkpoint(tmp_path / "bare.safetensors", fresh, fresh_opt, settings={"batch": 8})


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(torch.bfloat16, accumulation=2), Recipe(
    torch.float16, True, 4, channels_last=True, compile_mode="max-autotune")])
def test_a_recipe_comes_back_from_its_name(recipe: Recipe) -> None:
    assert Recipe.from_name(recipe.name, accumulation=recipe.accumulation) == recipe
    for bad in ("fp8+channels_last", "fp32+channels_first", "fp32+compile+compile:max-autotune"):
        with pytest.raises(ValueError, match="name must be a Recipe.name"):
            Recipe.from_name(bad)


def test_a_checkpoint_rank_0_cannot_write_leaves_no_cycle_holding_the_model(tmp_path, monkeypatch) -> None:
    """Rank 0's write error is raised after every rank agreed; its traceback must not keep the model
    (under DDP: the process group, whose gloo threads would outlive the interpreter and abort it)
    alive in a reference cycle until a GC pass."""
    import kernels.training as T

    monkeypatch.setattr(T, "active", lambda: True)  # rank 0 of a group of one: agree() is the identity
    monkeypatch.setattr(T, "rank", lambda: 0)
    monkeypatch.setattr(T, "agree", lambda ok: ok)
    model = nn.Linear(3, 2)
    alive = weakref.ref(model)
    gc.disable()
    try:
        try:
            T.save_checkpoint(tmp_path / "missing-folder" / "x.safetensors", model,
                              torch.optim.SGD(model.parameters()))
        except OSError:
            pass
        else:
            pytest.fail("save_checkpoint wrote into a folder that does not exist")
        del model
        assert alive() is None, "the model outlived its last reference (a cycle through the raised error)"
    finally:
        gc.enable()


def test_bad_checkpoints_are_refused(tmp_path) -> None:
    from kernels.training import load_checkpoint, save_checkpoint

    model, opt, sched = _resumable(0)
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(path, model, opt, step=-1)
    save_checkpoint(path, model, opt, scheduler=sched, step=1)
    with pytest.raises(ValueError, match="holds scheduler state but scheduler= was not passed"):
        load_checkpoint(path, model, opt)
    with pytest.raises(ValueError, match="holds no scaler state but scaler= was passed"):
        load_checkpoint(path, model, opt, scheduler=sched, scaler=torch.amp.GradScaler("cpu"))
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    two_groups = torch.optim.SGD([{"params": first}, {"params": rest, "lr": 0.01}], lr=0.1)
    save_checkpoint(tmp_path / "groups.safetensors", model, two_groups)
    with pytest.raises(ValueError, match="different number of parameter groups"):  # not the first group alone
        load_checkpoint(tmp_path / "groups.safetensors", model, torch.optim.SGD(first, lr=0.1))
    with pytest.raises(RuntimeError, match="size mismatch"):  # another model's checkpoint
        load_checkpoint(path, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4)),
                        opt, scheduler=sched)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fails its checksum"):
        load_checkpoint(path, model, opt, scheduler=sched)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.safetensors", model, opt)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    lam.base_lrs = [object()]  # a state value JSON cannot hold
    with pytest.raises(TypeError, match="JSON cannot store"):
        save_checkpoint(path, model, opt, scheduler=lam)


class _TemperedLoss(nn.Module):
    """Cross-entropy at a learned temperature: a loss module whose parameter the optimizer trains."""

    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out * self.log_t.exp(), y)


def test_a_loss_modules_parameters_are_saved_and_resumed(tmp_path) -> None:
    """An optimizer training a loss module's parameter: the checkpoint holds its value (a resume
    restarted it from its initial value, the temperature 1.19 in the run and -0.56 resumed, and
    the losses went apart silently); without loss_fn= the save is refused, naming it."""
    from kernels.training import load_checkpoint, save_checkpoint

    def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        model, _ = _setup()
        loss = _TemperedLoss()
        return model, loss, torch.optim.SGD([*model.parameters(), *loss.parameters()], lr=0.2, momentum=0.9)

    data = _data(8, 8)
    model, loss, opt = build()
    straight = train(model, loss, opt, data).losses
    model2, loss2, opt2 = build()
    first = train(model2, loss2, opt2, data[:4]).losses
    with pytest.raises(ValueError, match="not the model's.*pass it as loss_fn="):
        save_checkpoint(tmp_path / "ckpt.safetensors", model2, opt2, step=4)
    save_checkpoint(tmp_path / "ckpt.safetensors", model2, opt2, step=4, loss_fn=loss2)
    model3, loss3, opt3 = build()
    with pytest.raises(ValueError, match="holds loss_fn state but loss_fn= was not passed"):
        load_checkpoint(tmp_path / "ckpt.safetensors", model3, opt3)
    assert load_checkpoint(tmp_path / "ckpt.safetensors", model3, opt3, loss_fn=loss3) == 4
    assert first + train(model3, loss3, opt3, data[4:]).losses == straight
    torch.testing.assert_close(loss3.log_t.detach(), loss.log_t.detach(), atol=0, rtol=0)


def test_a_scaler_or_scheduler_that_would_change_nothing_is_refused() -> None:
    """A disabled GradScaler skips nothing and turned the gradient check off (a NaN gradient
    reached the weights silently); a scheduler of another optimizer never set this one's lr; a
    ReduceLROnPlateau raised only after the first step had changed the weights."""
    model, opt = _setup()
    before = _params(model).clone()
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    data = _data(2, 8)
    with pytest.raises(ValueError, match="scaler is disabled"):
        train(model, F.cross_entropy, opt, data, Recipe(grad_scaler=True),
              scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match="scheduler was built on another optimizer"):
        train(model, F.cross_entropy, opt, data, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ValueError, match="ReduceLROnPlateau, which steps on a metric"):
        train(model, F.cross_entropy, opt, data, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    torch.testing.assert_close(_params(model), before, atol=0, rtol=0)


def test_sparse_gradients_train_as_torchs_loop_does() -> None:
    """nn.Embedding(sparse=True) with torch's SGD: the finiteness check reads the stored values
    (it raised NotImplementedError for aminmax on SparseCPU at the first step)."""
    def run(side) -> Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 10, (5, 2), generator=gen), torch.randint(0, 3, (5,), generator=gen))
                for _ in range(3)]
        side.train(model, F.cross_entropy, opt, data)
        return _params(model)

    import kernels.training as kt

    torch.testing.assert_close(run(kt), run(ref), atol=0, rtol=0)


@pytest.mark.parametrize("where", [0, 1])
def test_an_empty_batch_is_refused_by_index(where: int) -> None:
    """A batch with no samples: its mean loss is 0/0 (a ZeroDivisionError first in a window, a
    'loss nan' blaming the data later in it)."""
    model, opt = _setup()
    data = _data(2, 8)
    data[where] = (data[where][0][:0], data[where][1][:0])
    with pytest.raises(ValueError, match=f"batch {where} has no samples"):
        train(model, F.cross_entropy, opt, data, Recipe(accumulation=2))
