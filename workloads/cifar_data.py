"""The CIFAR input pipeline as the EPAi ResNet seed ran it: a Dataset of stored (uint8) images,
each augmented when it is read (random crop with 4 pixels of padding, horizontal flip, normalize;
torchvision.transforms.v2), batched by a DataLoader with ``num_workers``, ``pin_memory`` on CUDA,
``persistent_workers`` and ``prefetch_factor``. The engine copies a pinned batch with
``non_blocking=True``, and workers prepare the next batches while a step computes.

Item i's augmentation is drawn from its own seed (seed, epoch, i) and the order from a seeded
generator, so the batches do not depend on the number of workers: a run with 2 workers trains on
exactly the batches a run with 0 does.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from kernels.distributed import DataParallel

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's, as the seed normalizes


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
        """Draw new augmentations (call before each epoch, in the main process)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        # the item's own seed, in a forked CPU RNG: any worker draws the same crop and flip for
        # it, and the caller's global RNG is left as it was (torch.manual_seed would also seed
        # every accelerator: 138 us an item against 7)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + i) % 2**63)
            return self.transform(self.images[i]), self.labels[i]


def loader(images: Tensor, labels: Tensor, *, batch: int, workers: int = 0, seed: int = 0, device: str = "cpu",
           augment: bool = True, dp: DataParallel | None = None) -> DataLoader:
    """Shuffled (seeded) batches of ``batch`` augmented images; ``workers`` DataLoader workers,
    kept across epochs, each 2 batches ahead; pinned host memory when training on CUDA. ``dp``
    (data parallel, kernels.distributed): this rank's share of each epoch through a
    DistributedSampler, ``batch`` images per rank; call ``loader.sampler.set_epoch(e)`` each epoch."""
    if batch < 1 or workers < 0:
        raise ValueError(f"batch must be >= 1 and workers >= 0, got batch={batch}, workers={workers}")
    data = AugmentedCifar(images, labels, seed, augment)
    order = (dict(shuffle=True, generator=torch.Generator().manual_seed(seed)) if dp is None
             else dict(sampler=dp.sampler(data, shuffle=True, seed=seed, drop_last=True)))
    return DataLoader(data, batch_size=batch, drop_last=True, num_workers=workers,
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=2 if workers else None, **order)
