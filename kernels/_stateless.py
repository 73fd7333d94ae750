"""``torch.func.functional_call`` that leaves the module holding its own parameters and buffers.

torch 2.14.1's functional_call (``tie_weights=True``) swaps the given tensor into every name of a
parameter, and puts the originals back in the same order. A module registered under two names
(one layer applied twice, ``nn.ModuleList([block] * n)``) has one slot reached by both, swapped
twice: its second "original" is the tensor the first swap put there, so the module is left
holding the call's tensors (under vmap, wrappers without storage) in place of its own parameters,
and an optimizer built on them no longer updates the model. ``functional_call`` here puts every
parameter and buffer slot it finds changed back to what it held before the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def functional_call(module: nn.Module, tensors: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
                    args: Any, kwargs: dict[str, Any] | None = None) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, the module's own parameter
    and buffer slots as they were afterwards (module note), also when the call raises."""
    slots = [(table, name, t) for m in module.modules() for table in (m._parameters, m._buffers)
             for name, t in table.items()]
    try:
        return torch.func.functional_call(module, tensors, args, kwargs)
    finally:
        for table, name, t in slots:
            if table.get(name) is not t:
                table[name] = t
