"""The CIFAR input pipeline as the EPAi ResNet seed ran it: a Dataset of stored (uint8) images,
each augmented when it is read (random crop with 4 pixels of padding, horizontal flip, normalize;
torchvision.transforms.v2), batched by a DataLoader with ``num_workers``, ``pin_memory`` on CUDA,
``persistent_workers`` and ``prefetch_factor``. The engine copies a pinned batch with
``non_blocking=True``, and workers prepare the next batches while a step computes.

Item i's augmentation is drawn from its own seed (seed, epoch, i) and each epoch's order from a
permutation seeded by (seed, epoch), so the batches do not depend on the number of workers: a run
with 2 workers trains on exactly the batches a run with 0 does. The sampler hands each worker the
epoch with every index, as persistent workers keep the copy of the dataset they started with:
each pass over a loader is a new epoch, with a new order and new crops and flips.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from kernels.distributed import DataParallel

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's, as the seed normalizes


def mixed_seed(*parts: int) -> int:
    """One 63-bit seed from ``parts`` (seed, epoch[, item]): a different one for each."""
    out = 0
    for part in parts:
        out = (out * 1_000_003 + part) % 2**63
    return out


def as_stored(x: Tensor) -> Tensor:
    """Standardized float images (N, 3, H, W) as uint8 pixels at CIFAR-10's per-channel mean and
    spread: the form a dataset keeps on disk (synthetic images enter the pipeline as real ones)."""
    if x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
        raise ValueError(f"x must be float images (N, 3, H, W), got {tuple(x.shape)} {x.dtype}")
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((x * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)


class AugmentedCifar(Dataset):
    """(image (3, 32, 32) float32, normalized and, with ``augment``, cropped and flipped; label)."""

    def __init__(self, images: Tensor, labels: Tensor, seed: int = 0, augment: bool = True) -> None:
        from torchvision.transforms import v2

        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (N, 3, H, W), got {tuple(images.shape)} {images.dtype}")
        if labels.shape != images.shape[:1] or labels.dtype != torch.int64:
            raise ValueError(f"labels must be ({len(images)},) int64, got {tuple(labels.shape)} {labels.dtype}")
        self.images, self.labels, self.seed, self.epoch = images, labels, seed, 0
        crop_flip = [v2.RandomCrop(images.shape[-1], padding=4), v2.RandomHorizontalFlip()] if augment else []
        self.transform = v2.Compose([*crop_flip, v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentations a plain index ``ds[i]`` draws (an index from
        ``EpochSampler`` carries its own epoch)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Item ``index``, or (epoch, item) as ``EpochSampler`` hands them to the workers."""
        epoch, i = index if isinstance(index, tuple) else (self.epoch, index)
        # the item's own seed, in a forked CPU RNG: any worker draws the same crop and flip for
        # it, and the caller's global RNG is left as it was (torch.manual_seed would also seed
        # every accelerator: 138 us an item against 7)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(mixed_seed(self.seed, epoch, i))
            return self.transform(self.images[i]), self.labels[i]


class EpochSampler(Sampler[tuple[int, int]]):
    """(epoch, item) pairs, one epoch a pass: the items in a permutation seeded by (seed, epoch),
    or in ``shares``'s order for the epoch (a DistributedSampler: this rank's share). The epoch
    goes with each index to the worker that reads it, as a persistent worker never sees the main
    process's dataset again. Each pass advances the epoch by one; ``set_epoch`` sets the next."""

    def __init__(self, n: int, seed: int, shares: DistributedSampler | None = None) -> None:
        self.n, self.seed, self.shares, self.epoch = n, seed, shares, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (the following ones count on from it)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n if self.shares is None else len(self.shares)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # the whole epoch's order now, not lazily, so the epoch advances when the pass starts
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self.shares is None:
            generator = torch.Generator().manual_seed(mixed_seed(self.seed, epoch))
            order = torch.randperm(self.n, generator=generator).tolist()
        else:
            self.shares.set_epoch(epoch)
            order = list(self.shares)
        return iter([(epoch, i) for i in order])


def loader(images: Tensor, labels: Tensor, *, batch: int, workers: int = 0, seed: int = 0, device: str = "cpu",
           augment: bool = True, dp: DataParallel | None = None) -> DataLoader:
    """Shuffled (seeded) batches of ``batch`` augmented images; ``workers`` DataLoader workers,
    kept across epochs, each 2 batches ahead; pinned host memory when training on CUDA. Each pass
    over the loader is the next epoch (``loader.sampler.set_epoch(e)`` sets it). ``dp`` (data
    parallel, kernels.distributed): this rank's share of each epoch through a DistributedSampler,
    ``batch`` images per rank."""
    if batch < 1 or workers < 0:
        raise ValueError(f"batch must be >= 1 and workers >= 0, got batch={batch}, workers={workers}")
    data = AugmentedCifar(images, labels, seed, augment)
    shares = None if dp is None else dp.sampler(data, shuffle=True, seed=seed, drop_last=True)
    # the generator only seeds the workers' base seed (the items seed themselves), drawn from it
    # rather than from the caller's global RNG
    return DataLoader(data, batch_size=batch, drop_last=True, num_workers=workers,
                      sampler=EpochSampler(len(data), seed, shares), generator=torch.Generator().manual_seed(seed),
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=2 if workers else None)
