"""The one set of argument checks behind every public name: each returns the value it accepted or
raises with the argument's name, what it got and what would work.

Python's bool is an int subclass, so ``integer``/``number`` refuse it explicitly (``offset=True``
is a mistake, not position 1); numpy and torch scalars are accepted through ``operator.index``
and ``float``. ``finite`` reads one sum a tensor and one host sync for all of them: a NaN or an
inf makes the sum NaN or inf (where ``isfinite(t).all()`` writes a mask of the tensor first), and
only a tensor whose sum is not finite (NaN or inf in it, or finite values overflowing the sum) is
read again, exactly, by its extremes (``aminmax``, a slower reduction).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from typing import Any, NoReturn

import torch
from torch import Tensor, nn


def _boolish(value: Any) -> bool:
    """A bool in any costume: Python's, numpy's, or a bool tensor."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")) or (
        isinstance(value, Tensor) and value.dtype == torch.bool)


def _what(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, Tensor) else \
        f"a {value.dtype} tensor of shape {tuple(value.shape)}"


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = None, hint: str = "") -> int:
    """An int (numpy/torch integer scalars too, never a bool) in [low, high]; ``hint`` says what
    the argument is for, in the message."""
    try:
        v = None if _boolish(value) else operator.index(value)
    except TypeError:
        v = None
    if v is None or (low is not None and v < low) or (high is not None and v > high):
        why = f" ({hint})" if hint else ""
        raise ValueError(f"{name} must be an int{_range(low, high)}, got {_what(value)}{why}")
    return v


def _range(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None and not low_open:
        return f" in [{low}, {high}{')' if high_open else ']'}"
    bounds = ([f"{'>' if low_open else '>='} {low}"] * (low is not None)
              + [f"{'<' if high_open else '<='} {high}"] * (high is not None))
    return " " + " and ".join(bounds) if bounds else ""


def number(value: Any, name: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """A finite real number (not a bool) in [low, high]; ``low_open``/``high_open`` leave that end
    out. ``hint`` says why the range, in the message."""
    scalar = isinstance(value, Tensor) and value.numel() == 1 and value.dtype.is_floating_point
    # no bool (numpy's too), text, bytes or complex (numpy's dropped its imaginary part in float())
    ok = scalar or not (_boolish(value) or isinstance(value, str | bytes | complex | Tensor)
                        or "complex" in type(value).__name__)
    try:
        v = float(value) if ok else math.nan
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range
        v = math.nan
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if not math.isfinite(v) or below or above:
        why = f" ({hint})" if hint else ""
        raise ValueError(f"{name} must be a finite number{_range(low, high, low_open, high_open)}, "
                         f"got {_what(value)}{why}")
    return v


def flag(value: Any, name: str) -> bool:
    """True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_what(value)}")
    return value


def choice(value: Any, name: str, options: Collection[Any]) -> Any:
    """One of ``options`` (compared with ==; bools are not taken for 0/1, nor 0/1 for bools,
    nor a tensor for a number)."""
    bools = any(isinstance(o, bool) for o in options)
    if (isinstance(value, Tensor) or _boolish(value) != bools and (_boolish(value) or isinstance(value, int))
            or value not in options):
        raise ValueError(f"{name} must be one of {tuple(options)}, got {_what(value)}")
    return value


def module(value: Any, name: str = "model") -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def tensor(value: Any, name: str, *, ndim: int | tuple[int, ...] | None = None, min_ndim: int = 0,
           floating: bool = False, dtypes: Collection[torch.dtype] | None = None,
           nonempty: bool = False, shape: str = "") -> Tensor:
    """A dense torch.Tensor with ``ndim`` (one or several allowed) or at least ``min_ndim`` dims, a
    floating dtype or one of ``dtypes``, and (``nonempty``) at least one element. ``shape`` names
    the expected layout in the message, e.g. "(B, H, S, D)"."""
    want = f" of shape {shape}" if shape else ""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{want}, got {type(value).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if value.layout != torch.strided:  # sparse: the passes here index and stride dense memory
        raise TypeError(f"{name} must be a dense tensor, got layout {value.layout}; pass {name}.to_dense()")
    if (dims is not None and value.ndim not in dims) or value.ndim < min_ndim:
        need = want or (f" with {' or '.join(map(str, dims))} dims" if dims is not None else
                        f" with at least {min_ndim} dims")
        raise ValueError(f"{name} must be a tensor{need}, got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}; cast with .float()")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {tuple(str(d) for d in dtypes)}, got {value.dtype}")
    if nonempty and value.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(value.shape)}); pass at least one element")
    return value


def same_device(named: Mapping[str, Tensor]) -> torch.device:
    """The one device all of ``named`` live on; else an error naming each one's device."""
    if not named:
        raise ValueError("same_device needs at least one tensor")
    by_device: dict[torch.device, list[str]] = {}
    for n, t in named.items():
        by_device.setdefault(t.device, []).append(n)
    if len(by_device) > 1:
        where = "; ".join(f"{ns[0]}{f' (and {len(ns) - 1} more)' if len(ns) > 1 else ''} on {d}"
                          for d, ns in by_device.items())
        raise ValueError(f"{where}: move them to one device")
    return next(iter(by_device))


def tangent(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` carries a forward-mode AD tangent (a C pass would drop it)."""
    import torch.autograd.forward_ad as fwAD

    return fwAD._current_level >= 0 and any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def extremes(named: Mapping[str, Tensor]) -> dict[str, tuple[float, float]]:
    """(min, max) of each floating, non-empty tensor of ``named`` (others are left out), read with
    one host sync for all of them; NaN propagates to both."""
    checked = _readable(named)
    # each tensor's min and max, one pass (NaN propagates; inf shows as an extreme)
    values = _read([m for t in checked.values() for m in torch.aminmax(t)])
    return {n: (low, high) for n, low, high in zip(checked, values[::2], values[1::2], strict=True)}


def _readable(named: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The floating, non-empty tensors of ``named`` as the reductions read them (``_values``), detached."""
    named = {n: _values(t) for n, t in named.items()}
    return {n: t.detach() for n, t in named.items() if t.is_floating_point() and t.numel()}


def _read(found: list[Tensor]) -> list[float]:
    """0-d tensors read as Python floats with one host sync: stacked in their dtype, or in float64
    on the first one's device where they differ (stack needs one device and dtype)."""
    if not found:
        return []
    if len({(m.device, m.dtype) for m in found}) > 1:
        found = [m.to(found[0].device, torch.float64) for m in found]
    return torch.stack(found).tolist()


def _values(t: Tensor) -> Tensor:
    """What ``extremes`` reads of ``t``: its stored values where sparse, (re, im) pairs where complex,
    float32 where float8."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:  # CSR, CSC, BSR, BSC
        t = t.values()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.is_floating_point() and t.element_size() == 1:
        t = t.float()
    return t


def nonfinite(named: Mapping[str, Tensor]) -> list[str]:
    """The names of those of ``named`` holding NaN or inf (floating and complex tensors; others are
    finite by type), read with one host sync for all of them (module note)."""
    checked = _readable(named)
    # 16-bit values summed in float32: a half's sum would pass its 65504 on finite values
    sums = _read([t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum() for t in checked.values()])
    flagged = {n: t for (n, t), total in zip(checked.items(), sums, strict=True) if not math.isfinite(total)}
    return [n for n, (low, high) in extremes(flagged).items() if not (math.isfinite(low) and math.isfinite(high))]


def finite_extremes(named: Mapping[str, Tensor | tuple[float, float]], *, error: type[Exception] = ValueError,
                    hint: str = "") -> dict[str, tuple[float, float]]:
    """``finite``, returning the (min, max) it read (``extremes``) for the caller's own bounds. An
    entry given as a (low, high) pair was read by other means (bounds a C pass took of the values it
    read) and is checked alike, in its place."""
    read = extremes({n: t for n, t in named.items() if isinstance(t, Tensor)})
    found = {n: read[n] if isinstance(t, Tensor) else t for n, t in named.items()
             if n in read or not isinstance(t, Tensor)}
    bad = [n for n, (low, high) in found.items() if not (math.isfinite(low) and math.isfinite(high))]
    if bad:
        refuse_nonfinite(bad[0], error=error, hint=hint)
    return found


def finite(named: Mapping[str, Tensor], *, error: type[Exception] = ValueError, hint: str = "") -> None:
    """Every value of every tensor is finite; else ``error`` naming the first that holds NaN or inf."""
    bad = nonfinite(named)
    if bad:
        refuse_nonfinite(bad[0], error=error, hint=hint)


def span(t: Tensor) -> tuple[int, int]:
    """The bytes [start, end) of ``t``'s storage. Tensors whose spans meet may share memory: views
    of one storage, or two storages over one buffer (``torch.from_numpy`` of two overlapping
    slices), which comparing storages' start addresses alone would miss."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def overlapping(named: Mapping[str, Tensor]) -> tuple[str, str] | None:
    """Two of ``named`` whose storages' spans meet (``span``), the first found in address order;
    None where none do. Empty storages meet nothing."""
    spans = sorted((lo, hi, n) for n, t in named.items() for lo, hi in [span(t)] if hi > lo)
    reach, held = 0, ""  # the furthest end so far, and whose
    for lo, hi, n in spans:
        if lo < reach:
            return held, n
        if hi > reach:
            reach, held = hi, n
    return None


def writable(t: Tensor, name: str) -> None:
    """An ``out=`` tensor a kernel writes in place (C passes too): no autograd history, and no
    inference tensor outside inference mode (torch's own out= ops refuse both, less clearly)."""
    if t.requires_grad:
        raise ValueError(f"{name} requires grad; pass a tensor without autograd history (e.g. the previous "
                         "call's result, or t.detach())")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} is an inference tensor, which cannot be written outside torch.inference_mode(); "
                         "allocate it outside inference mode")


def refuse_nonfinite(name: str, *, error: type[Exception] = ValueError, hint: str = "") -> NoReturn:
    """Raise ``finite``'s error for ``name``, found to hold NaN or inf by other means (a C pass)."""
    raise error(f"NaN or inf in {name}{'; ' + hint if hint else ''}")
