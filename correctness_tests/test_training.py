"""kernels.training.train == reference.training.train where they must agree; AMP within a band."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import reference.training as ref
from correctness_tests.tolerances import REDUCTION, assert_close
from kernels.models import MLP
from kernels.training import Recipe, train


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


def _poison(x: torch.Tensor) -> torch.Tensor:
    """One overflowed activation (inf): its loss and gradients are not finite."""
    x = x.clone()
    x[0, 0] = float("inf")
    return x


@pytest.mark.parametrize("autocast", [None, torch.float16], ids=["fp32", "fp16"])
def test_overflowed_steps_are_skipped_never_applied(autocast: torch.dtype | None) -> None:
    """A batch whose gradients overflow is skipped: the parameters end exactly where a run
    without that batch ends, and the scheduler steps only for applied steps."""
    data = _data(4, 8)
    bad = [data[0], data[1], (_poison(data[2][0]), data[2][1]), data[3]]
    (m1, o1), (m2, o2) = _setup(), _setup()
    calls = []
    sched = torch.optim.lr_scheduler.LambdaLR(o1, lambda step: calls.append(step) or 1.0)
    calls.clear()  # LambdaLR evaluates once when built
    recipe = Recipe(autocast_dtype=autocast, grad_scaler=True)
    result = train(m1, F.cross_entropy, o1, bad, recipe, scheduler=sched)
    clean = train(m2, F.cross_entropy, o2, [data[0], data[1], data[3]], recipe)
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
    want = ref.train(other, F.cross_entropy, sgd(other), data)
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    assert_close(_params(net), _params(other), REDUCTION)


def test_recipe_auto() -> None:
    assert Recipe.auto("cpu") == Recipe()  # nothing to measure on: plain fp32
    cuda = Recipe.auto("cuda", accumulation=2)
    assert (cuda.autocast_dtype, cuda.grad_scaler, cuda.accumulation) == (torch.float16, True, 2)
    model, _ = _setup()
    x, y = _data(1, 16)[0]
    chosen = Recipe.auto("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert set(chosen.measured_ms) == {"fp32", "bfloat16"}  # channels_last only for images
    assert all(0 < ms < 1e4 for ms in chosen.measured_ms.values())
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
    with pytest.raises(ValueError, match="plain fp32"):
        ref.train(model, F.cross_entropy, opt, _data(1, 4), Recipe(accumulation=2))


@pytest.mark.parametrize(("bf16_ms", "chosen"), [(9.5, None), (8.5, torch.bfloat16)])
def test_recipe_auto_leaves_fp32_only_for_a_clear_win(monkeypatch, bf16_ms: float, chosen) -> None:
    """A candidate within AUTO_MARGIN (10%) of fp32 is timing noise, not worth lower precision."""
    import kernels.training as engine

    timed = {"fp32": 10.0, "bfloat16": bf16_ms}
    monkeypatch.setattr(engine, "_time_step", lambda recipe, *a, **k: timed[recipe.name])
    model, _ = _setup()
    x, y = _data(1, 16)[0]
    recipe = Recipe.auto("cpu", model=model, loss_fn=F.cross_entropy, batch=(x, y))
    assert recipe.autocast_dtype is chosen and recipe.measured_ms == timed


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
    bad = [data[0], (_poison(data[1][0]), data[1][1])]
    (m3, o3), (m4, o4) = _setup(), _setup()
    result = train(m3, F.cross_entropy, o3, bad, Recipe(grad_scaler=True), max_grad_norm=MAX_NORM)
    train(m4, F.cross_entropy, o4, bad[:1], Recipe(grad_scaler=True), max_grad_norm=MAX_NORM)
    assert result.skipped_steps == 1 and not math.isfinite(result.grad_norms[1])
    torch.testing.assert_close(_params(m3), _params(m4), atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1.0", True])
def test_bad_max_grad_norm_is_refused(bad) -> None:
    model, opt = _setup()
    for loop in (train, ref.train):
        with pytest.raises(ValueError, match="max_grad_norm must be None .* or a finite number > 0"):
            loop(model, F.cross_entropy, opt, _data(1, 4), max_grad_norm=bad)
