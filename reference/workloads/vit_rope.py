"""Reference run of the RoPE ViT workload: fp32, RoPE recomputed on every call and explicit
softmax attention (reference.attention), per-parameter Python AdamW, the plain loop."""

from __future__ import annotations

from reference.attention import RopeSelfAttention as attention
from reference.optim import adamw as optimizer
from reference.training import train

NAME = "reference (fp32, per-call RoPE, manual softmax, Python AdamW)"
__all__ = ["NAME", "attention", "optimizer", "train"]
