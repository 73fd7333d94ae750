"""The CIFAR input pipeline (workloads/cifar_data.py): the seed's augmentation, batches that do not
depend on the number of workers, and the engine trained from a loader as the reference is from
the same batches in a list."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reference.training as ref
from correctness_tests.tolerances import REDUCTION, assert_close
from kernels.distributed import DataParallel
from kernels.models import ResNet10
from kernels.training import train
from workloads.cifar_data import STD, AugmentedCifar, as_stored, loader
from workloads.cifar_resnet import synthetic_cifar

X, Y = synthetic_cifar(48, seed=3)
STORED = as_stored(X)


def test_stored_images_come_back_normalized_without_augmentation() -> None:
    ds = AugmentedCifar(STORED, Y, augment=False)
    x, y = ds[5]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and y == Y[5]
    # back to the synthetic image within half a pixel step, where the pixel was not clipped to 0 or 255
    inside = (STORED[5] > 0) & (STORED[5] < 255)
    assert (x - X[5])[inside].abs().max() <= 0.5 / 255 / min(STD) + 1e-6
    assert inside.float().mean() > 0.9


def test_augmentation_is_random_per_item_and_epoch_and_repeatable() -> None:
    ds = AugmentedCifar(STORED, Y, seed=1)
    plain = AugmentedCifar(STORED, Y, augment=False)
    first = torch.stack([ds[i][0] for i in range(16)])
    assert torch.equal(first, torch.stack([ds[i][0] for i in range(16)]))  # the same item, the same draw
    assert sum(not torch.equal(first[i], plain[i][0]) for i in range(16)) >= 12  # cropped or flipped
    ds.set_epoch(1)
    assert not torch.equal(first, torch.stack([ds[i][0] for i in range(16)]))
    state = torch.get_rng_state()
    list(loader(STORED, Y, batch=8))
    assert torch.equal(torch.get_rng_state(), state)  # the caller's global RNG is left alone


def test_batches_do_not_depend_on_the_number_of_workers() -> None:
    inline = list(loader(STORED, Y, batch=16, workers=0, seed=4))
    workers = list(loader(STORED, Y, batch=16, workers=2, seed=4))
    assert len(inline) == len(workers) == 3
    for (xa, ya), (xb, yb) in zip(inline, workers, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_data_parallel_ranks_read_disjoint_shares_of_each_epoch() -> None:
    """With ``dp`` each rank's loader reads its DistributedSampler share: 2 ranks together read
    every image of an epoch once (48 images, batches of 8 per rank), each with its augmentation."""
    ranks = [DataParallel(rank=r, world_size=2, local_rank=r, device=torch.device("cpu")) for r in (0, 1)]
    shares = [list(loader(STORED, Y, batch=8, seed=4, augment=False, dp=dp)) for dp in ranks]
    assert [len(s) for s in shares] == [3, 3]
    seen = torch.cat([x for share in shares for x, _ in share])
    plain = torch.stack([AugmentedCifar(STORED, Y, augment=False)[i][0] for i in range(48)])
    match = (seen.flatten(1)[:, None] == plain.flatten(1)[None]).all(-1)  # (48 read, 48 stored)
    assert match.sum(1).eq(1).all() and match.sum(0).eq(1).all()


def test_the_engine_trains_from_a_loader_as_the_reference_does_from_its_batches() -> None:
    """fp32: the engine reading a 2-worker loader as it trains, the reference loop the same
    batches materialized, each with plain SGD: the same losses and parameters."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(ResNet10())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=False) for m in models]
    got = train(models[0], F.cross_entropy, opts[0], loader(STORED, Y, batch=16, workers=2, seed=2))
    want = ref.train(models[1], F.cross_entropy, opts[1], list(loader(STORED, Y, batch=16, seed=2)))
    assert got.optimizer_steps == want.optimizer_steps == 3
    assert_close(torch.tensor(got.losses), torch.tensor(want.losses), REDUCTION)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert_close(a.detach(), b.detach(), REDUCTION)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="images must be uint8"):
        AugmentedCifar(X, Y)
    with pytest.raises(ValueError, match="labels must be"):
        AugmentedCifar(STORED, Y[:3])
    with pytest.raises(ValueError, match="x must be float images"):
        as_stored(STORED)
    with pytest.raises(ValueError, match="workers >= 0"):
        loader(STORED, Y, batch=8, workers=-1)


def _epochs(workers: int, n: int = 2, dp: DataParallel | None = None) -> list[dict[int, torch.Tensor]]:
    """``n`` passes over one loader of 32 images labelled 0..31 (so each image names its item):
    per pass, item -> its augmented image, in the order read."""
    ld = loader(STORED[:32], torch.arange(32), batch=8, workers=workers, seed=5, dp=dp)
    return [{int(i): x for xb, yb in ld for x, i in zip(xb, yb, strict=True)} for _ in range(n)]


def test_each_epoch_draws_new_augmentations_and_order_with_persistent_workers() -> None:
    """A second pass over one loader (workers kept between epochs) draws new crops and flips and
    a new order, and the same ones with 0, 1 or 2 workers."""
    inline = _epochs(0)
    first, second = inline
    assert list(first) != list(second)  # a new order
    assert sum(not torch.equal(first[i], second[i]) for i in first) >= 24  # new crops and flips
    for workers in (1, 2):
        for want, got in zip(inline, _epochs(workers), strict=True):
            assert list(got) == list(want) and all(torch.equal(got[i], want[i]) for i in want)


def test_each_epoch_of_a_data_parallel_share_draws_new_augmentations() -> None:
    """With ``dp`` (one of 2 ranks, a persistent worker) the passes advance the sampler's epoch:
    a new share and new draws each epoch, as ``sampler.set_epoch`` asks for them."""
    dp = DataParallel(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    first, second = _epochs(1, dp=dp)
    assert list(first) != list(second)
    both = set(first) & set(second)  # the items this rank reads in both epochs
    assert both and all(not torch.equal(first[i], second[i]) for i in both)
    ld = loader(STORED[:32], torch.arange(32), batch=8, workers=1, seed=5, dp=dp)
    ld.sampler.set_epoch(1)
    again = {int(i): x for xb, yb in ld for x, i in zip(xb, yb, strict=True)}
    assert list(again) == list(second) and all(torch.equal(again[i], second[i]) for i in second)


def test_crops_shift_up_to_4_pixels_and_half_the_images_are_flipped() -> None:
    """The seed's augmentation on a left-to-right ramp (no pixel 0): a crop from the image padded
    by 4 shows up to 4 rows or columns of padding (pixel 0), and a flip turns the ramp around."""
    from workloads.cifar_data import MEAN

    ramp = (100 + 4 * torch.arange(32)).to(torch.uint8).expand(200, 3, 32, 32).contiguous()
    ds = AugmentedCifar(ramp, torch.zeros(200, dtype=torch.int64), seed=7)
    padding = (0 - MEAN[0]) / STD[0]
    shifts, flips = set(), []
    for i in range(200):
        x = ds[i][0][0]
        pad = (x - padding).abs() < 1e-4
        shifts |= {int(pad.all(1).sum()), int(pad.all(0).sum())}  # padded rows, padded columns
        row = x[pad.all(1).logical_not()][0][pad.all(0).logical_not()]  # an image row, padding cut off
        flips.append(bool((row.diff() < 0).all()))
        assert flips[-1] or bool((row.diff() > 0).all())
    assert shifts == {0, 1, 2, 3, 4}
    assert 60 <= sum(flips) <= 140


def test_the_loader_drops_a_last_short_batch() -> None:
    """20 images in batches of 8: two batches of 8 an epoch, never a step on 4."""
    assert [len(y) for _, y in loader(STORED[:20], Y[:20], batch=8)] == [8, 8]


def test_labels_must_be_int64() -> None:
    with pytest.raises(ValueError, match="labels must be"):
        AugmentedCifar(STORED, Y.int())


def test_each_item_and_epoch_draws_its_own_augmentation() -> None:
    """The same image at items 0..7 of epoch 1 and items 1..8 of epoch 0: no pair shares a draw
    (a seed mixed so that (epoch 1, item i) and (epoch 0, item i + 1) collide would repeat them)."""
    same = STORED[:1].expand(16, 3, 32, 32).contiguous()
    ds = AugmentedCifar(same, torch.zeros(16, dtype=torch.int64), seed=3)
    assert sum(not torch.equal(ds[(1, i)][0], ds[(0, i + 1)][0]) for i in range(8)) >= 6
