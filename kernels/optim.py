"""Optimizer steps: the fastest correct ``torch.optim`` implementation for the parameters at hand.

``adamw`` and ``sgd`` return ``torch.optim.AdamW`` / ``torch.optim.SGD`` objects (subclasses that
add one step pre-hook that guards the fused step, see below, kept by ``copy.deepcopy``, and checks
on groups added later; GradScaler, LR schedulers, hooks and ``state_dict`` work as usual) with the
implementation chosen per optimizer and device type, as measured: fused on CPU, where it was
fastest for AdamW and SGD in fp32 and bf16 (evidence/from-the-code.md); on CUDA fused AdamW, and
torch's foreach SGD, whose fused step there was slower (evidence/perf-cuda-h200-roofline.txt).
Other device types get torch's default.

torch 2.14.1's fused kernels index parameter, grad and state as flat arrays, so a grad whose
strides differ from its parameter's (a transposed parameter with a grad set by hand, say) gets
silently wrong steps (correctness_tests/test_optim.py); state created before a model went
channels_last, or loaded from a state_dict, mis-steps the same way. Autograd's own grads follow
the parameter's layout, so plain training is unaffected, but these optimizers copy any grad or
state tensor laid out unlike its parameter into the parameter's layout before each fused step,
and never choose fused for a parameter that is a strided view (no layout of its own to match).
A group added with ``add_param_group`` to a fused optimizer must be fusable too (else a
ValueError: build the optimizer with every group). The implementation is chosen for all groups:
a group dict's own ``fused`` or ``foreach`` is refused, and one loaded with ``load_state_dict``
is replaced by this optimizer's. A tensor listed twice is refused (the fused step counts it twice
before either update: AdamW's bias correction then runs a step ahead).

Fused SGD with momentum creates its momentum buffers only when no parameter has one (torch
2.14.1): a parameter whose first gradient comes after step 1 raised a TypeError, and a first step
a GradScaler skipped kept uninitialised buffers (the weights then went to 1e26 or NaN). So each
parameter with a gradient and no buffer gets a zero one before the step: with dampening 0 the
fused update 0 * momentum + d is d, the first step's buffer, exactly; SGD with momentum and
dampening is not fused.

Hyperparameters are checked before torch sees them, the keyword arguments and every override in
a parameter-group dict alike (torch checks the keywords only, and lets ``lr=inf``, ``lr=True``,
a NaN SGD ``lr`` or any dampening through; a group dict is not checked at all): each is a finite
number, not a bool, in its range (``HYPERPARAMETERS``), else a ValueError naming it (``lr``, or
``params[1]['lr']`` for group 1). Ranges are torch's, two tighter: AdamW's ``eps`` must be > 0
(with 0 an element whose gradient has been 0 so far steps by 0/0 = NaN), and SGD's ``momentum``
< 1 (a factor of 1 or more never forgets a gradient: the buffer grows without bound). Numbers are
stored as Python floats; a tensor ``lr`` or ``betas`` (torch's capturable steps) is checked by
its value and kept, and each must be representable where the step computes (float32 for all but
float64 parameters): an ``eps`` that rounds to 0 there, or an ``lr`` or ``weight_decay`` that
rounds to inf, is refused. Groups added later with ``add_param_group``, and the saved groups
``load_state_dict`` puts in place of the groups' own, are checked alike. torch.optim's variants
(AdamW's ``amsgrad``, ``maximize``, ``capturable``, ``differentiable``; SGD's ``maximize``,
``differentiable``) are not offered: a group asking for one is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from kernels import checks

Params = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]
# Where we choose torch's fused step, by optimizer (module note), and where its foreach step, named
# rather than left to torch's default (which a later torch could make fused, without the guard below):
# CUDA's fused SGD (with its guard) ran 0.67-0.71x of torch's foreach SGD on resnet18's parameters on an
# H100 and an H200.
FUSED_DEVICES = {"adamw": ("cpu", "cuda"), "sgd": ("cpu",)}
FOREACH_DEVICES = {"adamw": (), "sgd": ("cuda",)}


def _members(params: object, arg: str) -> list:
    """A group dict's params as torch reads them: one tensor is one parameter (not its rows)."""
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError(f"{arg}'s groups must list their params in an order (a list), got a set: the "
                        "optimizer state is matched to parameters by position")
    return list(params)


def _groups(params: Params, arg: str) -> list:
    """Parameter groups with their params materialized (a generator inside a group dict would
    otherwise be used up by validation), each a real floating or complex tensor."""
    if isinstance(params, Tensor):
        raise TypeError(f"{arg} must be an iterable of tensors or parameter groups, got a Tensor; "
                        "pass model.parameters() or [tensor]")
    groups = [dict(g, params=_members(g["params"], arg)) if isinstance(g, dict) else g for g in params]
    if not groups:
        raise ValueError(f"{arg} is empty: the optimizer has nothing to update")
    for g in groups:
        for p in g["params"] if isinstance(g, dict) else [g]:
            p = p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p
            if not isinstance(p, Tensor):
                raise TypeError(f"{arg} holds a {type(p).__name__}, not a tensor")
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"{arg} holds a {p.dtype} tensor: optimizers update floating-point "
                                "parameters only")
    tensors = _tensors(groups)
    if len({id(p) for p in tensors}) != len(tensors):
        # the fused step counts a tensor listed twice twice before either update: AdamW's bias
        # correction then runs a step ahead (4e-2 off in 3 steps); torch only warns
        raise ValueError(f"{arg} lists a tensor more than once; list each parameter once (model.parameters() "
                         "does: a tied weight is one parameter)")
    return groups


def _fraction(value: Any, name: str) -> float:
    """A decay factor in [0, 1)."""
    return checks.number(value, name, low=0, high=1, high_open=True,
                         hint="a factor of 1 or more never forgets a gradient: its buffer grows without bound")


def _betas(value: Any, name: str) -> tuple:
    if isinstance(value, str | Tensor) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2) of numbers in [0, 1), got {value!r}")
    return tuple(_kept(b, _fraction(b, f"{name}[{i}]")) for i, b in enumerate(value))


def _kept(value: Any, checked: Any) -> Any:
    """A tensor hyperparameter stays a tensor (torch's capturable steps read it on the device)."""
    return value if isinstance(value, Tensor) else checked


# Each hyperparameter's check, by optimizer: it returns the value to store (see the module note).
HYPERPARAMETERS: dict[str, dict[str, Callable[[Any, str], Any]]] = {
    "adamw": {"lr": lambda v, n: _kept(v, checks.number(v, n, low=0)),
              "betas": _betas,
              "eps": lambda v, n: checks.number(v, n, low=0, low_open=True),
              "weight_decay": lambda v, n: _kept(v, checks.number(v, n, low=0))},
    "sgd": {"lr": lambda v, n: _kept(v, checks.number(v, n, low=0)),
            "momentum": _fraction,
            "dampening": lambda v, n: checks.number(v, n, low=0, high=1),
            "weight_decay": lambda v, n: _kept(v, checks.number(v, n, low=0)),
            "nesterov": checks.flag},
}


def _hyperparameters(kind: str, given: dict[str, Any], groups: list) -> dict[str, Any]:
    """``given`` (the keyword arguments) checked, and in place every group dict's overrides of
    them (``_group``); returns the checked keywords."""
    rules = HYPERPARAMETERS[kind]
    defaults = {k: rules[k](v, k) for k, v in given.items()}
    dicts = [g for g in groups if isinstance(g, dict)]
    for i, g in enumerate(dicts):
        _group(kind, g, defaults, f"params[{i}]")
    if not dicts:  # plain tensors: one group of the keywords as they are
        _group(kind, {"params": _tensors(groups)}, defaults, "got")
    return defaults


# What torch's class reads from a group beyond HYPERPARAMETERS: the implementation, kernels'
# choice for all groups (a group's own "fused" skipped the layout guard: 0.87 off on a strided
# view), and variants that are torch.optim's alone (the reference has none), at their off values.
IMPLEMENTATION = ("fused", "foreach")
VARIANTS = {"adamw": {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False},
            "sgd": {"maximize": False, "differentiable": False}}


def _group(kind: str, group: dict[str, Any], defaults: dict[str, Any], where: str) -> None:
    """A group dict's overrides checked in place (``where[key]`` in an error), then the group as
    it will run: Nesterov's condition, and each number where its step computes (module note)."""
    rules = HYPERPARAMETERS[kind]
    for key in IMPLEMENTATION:
        if group.get(key) is not None:
            raise ValueError(f"{where}[{key!r}]={group[key]!r}: kernels.{kind} chooses the implementation for all "
                             "groups (module note); leave the key out of the group")
    for key, off in VARIANTS[kind].items():
        if group.get(key, off) != off:
            raise ValueError(f"{where}[{key!r}]={group[key]!r}: kernels.{kind} runs without "
                             f"{', '.join(VARIANTS[kind])}; use torch.optim's own class for that variant")
    group.update({k: rules[k](group[k], f"{where}[{k!r}]") for k in rules if k in group})
    run = {**defaults, **group}
    if kind == "sgd" and run["nesterov"] and (run["momentum"] == 0 or run["dampening"] != 0):
        runs = "got" if where == "got" else f"{where} runs with"
        raise ValueError(f"nesterov=True needs momentum > 0 and dampening 0; {runs} momentum "
                         f"{run['momentum']} and dampening {run['dampening']}")
    if any(p.dtype != torch.float64 for p in _tensors(group["params"])):  # computed in float32
        for key in ("lr", "eps", "weight_decay"):
            value = run.get(key)
            if isinstance(value, Tensor):  # a tensor lr or weight_decay: by its value (module note)
                value = float(value)
            rounded = float(torch.tensor(value, dtype=torch.float32)) if isinstance(value, float) else None
            if rounded is not None and value != 0 and rounded in (0.0, math.inf):
                name = key if where == "got" or key not in group else f"{where}[{key!r}]"
                raise ValueError(f"{name}={value!r} rounds to {rounded} in float32, where the "
                                 "step computes for float32, bf16 and fp16 parameters; pass a value float32 holds "
                                 f"({torch.finfo(torch.float32).smallest_normal:g} to "
                                 f"{torch.finfo(torch.float32).max:g}), or float64 parameters")


def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense: a tensor laid out as one of its own permutations."""
    return torch.empty_like(t, memory_format=torch.preserve_format).stride() == t.stride()


def _aligned(t: Tensor, like: Tensor) -> Tensor:
    return torch.empty_like(like, memory_format=torch.preserve_format).copy_(t)


def _align(optimizer: torch.optim.Optimizer) -> None:
    """Give every grad and state tensor its parameter's strides (see the module note)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.numel() <= 1:
                continue
            if p.grad.is_sparse:
                raise TypeError("a sparse gradient reached a fused optimizer; use torch.optim.SGD "
                                "(sparse-capable) or torch.optim.SparseAdam for sparse embeddings")
            if p.grad.stride() != p.stride():
                p.grad = _aligned(p.grad, p)
            state = optimizer.state.get(p, {})
            for key, v in state.items():
                if isinstance(v, Tensor) and v.shape == p.shape and v.stride() != p.stride():
                    state[key] = _aligned(v, p)  # e.g. the model went channels_last after step 1


def _momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD: a zero momentum buffer for each parameter with a gradient and none yet (module note)."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if p.grad is not None and optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _guard(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Align layouts (and give fused SGD its momentum buffers) before each fused step, closures
    included (their grads are made inside)."""
    if not optimizer.defaults.get("fused"):
        return optimizer

    def prepare(opt: torch.optim.Optimizer) -> None:
        _align(opt)
        if isinstance(opt, torch.optim.SGD):
            _momentum_buffers(opt)

    def pre_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict):
        # torch passes step's own arguments: args = (optimizer, [closure])
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        prepare(opt)
        if closure is None:
            return None

        def aligned_closure() -> Any:
            loss = closure()
            prepare(opt)
            return loss

        return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": aligned_closure}

    if getattr(optimizer, "_kernels_guard", None) in optimizer._optimizer_step_pre_hooks:
        return optimizer  # guarded already: load_state_dict runs __setstate__ again
    optimizer._kernels_guard = optimizer.register_step_pre_hook(pre_hook).id  # type: ignore[attr-defined]
    return optimizer


def implementation(kind: str, params: list[Tensor], dampened: bool = False) -> dict[str, bool]:
    """The ``fused``/``foreach`` keywords of optimizer ``kind`` for these parameters, as measured
    (module note): fused on one device of ``FUSED_DEVICES[kind]`` for dense real floating
    parameters; foreach on one device of ``FOREACH_DEVICES[kind]``; otherwise torch's own default
    (fused kernels mis-step strided views and do not take complex parameters; SGD with momentum and
    dampening, ``dampened``, has no exact zero buffer to start from)."""
    devices = {p.device.type for p in params}
    if len(devices) != 1:
        return {}
    if devices <= set(FOREACH_DEVICES[kind]):
        return {"foreach": True}
    if (devices <= set(FUSED_DEVICES[kind]) and not dampened
            and all(p.is_floating_point() and _dense(p) for p in params)):
        return {"fused": True}
    return {}


def _tensors(groups: list) -> list[Tensor]:
    ps = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return [p[1] if isinstance(p, tuple) else p for p in ps]


def _dampened(defaults: dict[str, Any], groups: list) -> bool:
    """Whether an SGD group runs with momentum and dampening (no fused step: ``implementation``)."""
    runs = [{**defaults, **g} for g in groups if isinstance(g, dict)] or [defaults]
    return any(r.get("momentum", 0) != 0 and r.get("dampening", 0) != 0 for r in runs)


class _Chosen:
    """What kernels adds to torch's optimizer class: the guard again after ``copy.deepcopy`` or
    unpickling (torch's ``__getstate__`` leaves step hooks out), and a group added later checked
    as the constructor's are, and refused where the fused step chosen for the first cannot take it."""

    kind: str

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        _guard(self)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the saved groups' hyperparameters checked as the constructor's are (torch
        puts them in place of the groups' own) and the implementation kept this optimizer's."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise TypeError("state_dict must be an optimizer's state_dict(): a dict whose 'param_groups' is a "
                            "list of dicts")
        checked = []
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups, strict=False)):  # torch counts them
            # checked against this group's tensors (the saved one lists their indices)
            group = {k: v for k, v in saved.items() if k not in IMPLEMENTATION} | {"params": mine["params"]}
            _group(self.kind, group, {}, f"state_dict['param_groups'][{i}]")
            implementation = {k: mine[k] for k in IMPLEMENTATION if k in mine}
            checked.append(group | implementation | {"params": saved["params"]})
        super().load_state_dict({**state_dict, "param_groups": checked + groups[len(checked):]})  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict with 'params', got {type(param_group).__name__}")
        group = _groups([param_group], "param_group")[0]
        defaults = self.defaults  # type: ignore[attr-defined]
        _group(self.kind, group, {k: v for k, v in defaults.items() if k in HYPERPARAMETERS[self.kind]},
               "param_group")
        chosen = implementation(self.kind, _tensors([group]), _dampened(defaults, [group]))
        if defaults.get("fused") and not chosen.get("fused"):
            raise ValueError(f"param_group cannot take the fused step kernels.{self.kind} chose for this "
                             "optimizer's parameters (a strided view, a complex parameter, another device, or SGD "
                             "momentum with dampening): build the optimizer with every group, "
                             f"kernels.{self.kind}([group, ...]), so the choice covers them all")
        super().add_param_group(group)  # type: ignore[misc]


class AdamW(_Chosen, torch.optim.AdamW):
    kind = "adamw"


class SGD(_Chosen, torch.optim.SGD):
    kind = "sgd"


def adamw(params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 1e-2) -> torch.optim.AdamW:
    """torch AdamW (decoupled weight decay, bias correction) with the fastest implementation.
    ``lr``, ``weight_decay`` >= 0, ``eps`` > 0, ``betas`` two numbers in [0, 1) (module note)."""
    groups = _groups(params, "params")
    hyper = _hyperparameters("adamw", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), groups)
    return _guard(AdamW(groups, **hyper, **implementation("adamw", _tensors(groups))))


def sgd(params: Params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False) -> torch.optim.SGD:
    """torch SGD (momentum, dampening, Nesterov, L2 weight decay) with the fastest implementation.
    ``lr``, ``weight_decay`` >= 0, ``momentum`` in [0, 1), ``dampening`` in [0, 1], ``nesterov``
    a bool (True needs momentum > 0 and dampening 0) (module note)."""
    groups = _groups(params, "params")
    hyper = _hyperparameters("sgd", dict(lr=lr, momentum=momentum, dampening=dampening,
                                         weight_decay=weight_decay, nesterov=nesterov), groups)
    return _guard(SGD(groups, **hyper, **implementation("sgd", _tensors(groups), _dampened(hyper, groups))))
