"""CUDA graphs as an ablation row: the optimized call captured once and replayed, so the row
beside ``optimized`` shows what kernel launches cost it at the suite's sizes (a kernel of tens of
microseconds can spend as long being launched). CUDA only: elsewhere the row is skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

GRAPHED = "optimized+cudagraphs"  # the row's impl name


def cuda_graphed(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``fn`` captured into a CUDA graph after 3 warm calls on a side stream (caches built and
    the allocator settled outside the capture, as torch.cuda.graphs documents); each call of the
    result replays it and returns the graph's output tensors, overwritten in place. Replay
    allocates nothing (the graph's memory pool is taken at capture), so the row's peak memory
    column reads about 0: not a memory saving."""
    if not device.startswith("cuda"):
        pytest.skip(f"{GRAPHED}: CUDA graphs need a CUDA device; this run is on {device}")
    # the perf session made its device current: the streams below and the replay are on it
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # torch's default capture stream is the first device's
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    return replay
