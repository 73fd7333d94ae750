"""Bad input never passes silently: every public name of ``kernels`` walked through every class of
bad input, each ending in a clear error (the exception and the words that name the argument) or
in an outcome its docstring documents and this file checks; then the validators themselves.

The table is the one place the walk is listed: a name added to ``kernels.__all__`` fails
``test_every_public_name_meets_every_class`` until each class has a case here, or a reason it
does not apply.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from correctness_tests.test_hypergrad import problem
from kernels import checks
from kernels.models import MLP

CLASSES = ("non_tensor", "wrong_rank", "wrong_dtype", "wrong_device", "empty", "nan", "inf", "bool_for_int",
           "out_of_range", "unowned_parameters")
OTHER = "meta"  # a second device on every machine: tensors there have shapes and no data
ce = F.cross_entropy


@dataclass(frozen=True)
class Raises:
    """The call raises ``exc`` with a message matching ``match`` (the argument's name and what works)."""

    call: Callable[[], Any]
    exc: type[Exception]
    match: str


@dataclass(frozen=True)
class Documented:
    """The call returns; ``check`` holds on its result, and ``phrase`` is in ``where``'s docstring."""

    call: Callable[[], Any]
    check: Callable[[Any], bool]
    where: Any
    phrase: str


@dataclass(frozen=True)
class NA:
    """The class cannot reach this name, and why."""

    why: str


R, D = Raises, Documented  # short names for the table's rows


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP((4, 5, 3)).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.arange(6) % 3


def _with(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[1] = value
    return t


def _nonfinite_param(value: float) -> nn.Module:
    m = _mlp()
    with torch.no_grad():
        m.net[0].weight[0, 0] = value
    return m


def _has_nonfinite(out: Any) -> bool:
    return not bool(torch.isfinite(out).all())


def _per_sample(name: str) -> dict[str, Any]:
    f = getattr(kernels, name)
    x, y = _batch()
    empty_ok = {"per_sample_grads": lambda r: all(t.shape[0] == 0 for t in r.values()),
                "per_sample_grad_gram": lambda r: r.shape == (0, 0),
                "per_sample_grad_norms": lambda r: r.shape == (0,)}[name]
    return {
        "non_tensor": R(lambda: f(_mlp(), ce, x.tolist(), y), TypeError, "inputs must be a torch.Tensor"),
        "wrong_rank": R(lambda: f(_mlp(), ce, x[0, 0], y), ValueError, r"inputs must be .*\(B, \.\.\.\)"),
        "wrong_dtype": R(lambda: f(_mlp(), ce, x.long(), y), TypeError, "inputs must be a floating"),
        "wrong_device": R(lambda: f(_mlp(), ce, x.to(OTHER), y.to(OTHER)), ValueError,
                               "inputs are on meta but model parameters on cpu"),
        "empty": D(lambda: f(_mlp(), ce, x[:0], y[:0]), empty_ok, f, "B = 0 gives"),
        "nan": R(lambda: f(_mlp(), ce, _with(x, math.nan), y), ValueError, "NaN or inf in inputs"),
        "inf": R(lambda: f(_nonfinite_param(math.inf), ce, x, y), ValueError,
                      "NaN or inf in model parameter 'net.0.weight'"),
        "bool_for_int": R(lambda: f(_mlp(), ce, x, y, chunk_size=True), ValueError,
                               "chunk_size must be an int >= 1, got bool"),
        "out_of_range": R(lambda: f(_mlp(), ce, x, y, chunk_size="abc"), ValueError,
                               "chunk_size must be an int >= 1, got str"),
        "unowned_parameters": NA("differentiates the model's own trainable parameters; no optimizer is involved"),
    }


def _ocs(name: str) -> dict[str, Any]:
    x, y = _batch()
    mem = (torch.randn(3, 4), torch.arange(3) % 3)

    def f(xs=x, ys=y, **kw):  # noqa: ANN001, ANN003, ANN202
        if name == "ocs_select":
            kw.setdefault("k", 2)
            return kernels.ocs_select(_mlp(), ce, xs, ys, kw.pop("k"), **kw)
        return kernels.ocs_scores(_mlp(), ce, xs, ys, **kw)

    cases = {
        "non_tensor": R(lambda: f(x.tolist()), TypeError, r"inputs \(the stream\) must be a torch.Tensor"),
        "wrong_rank": R(lambda: f(x[0, 0]), ValueError, r"inputs \(the stream\) must be .*\(N, \.\.\.\)"),
        "wrong_dtype": R(lambda: f(x.long()), TypeError, "inputs must be a floating"),
        "wrong_device": R(lambda: f(memory=(mem[0].to(OTHER), mem[1])), ValueError, "memory inputs .* must match"),
        "empty": R(lambda: f(x[:0], y[:0]), ValueError, r"inputs \(the stream\) is empty"),
        "nan": R(lambda: f(_with(x, math.nan)), ValueError, "NaN or inf in inputs"),
        "inf": R(lambda: f(memory=(_with(mem[0], math.inf), mem[1])), ValueError, "NaN or inf in memory inputs"),
        "bool_for_int": R(lambda: f(tau=True), ValueError, "tau must be a finite number, got bool"),
        "out_of_range": R(lambda: f(tau=math.inf), ValueError, "tau must be a finite number, got float inf"),
        "unowned_parameters": NA("scores with the model's own parameters; no optimizer is involved"),
    }
    if name == "ocs_select":
        cases["bool_for_int"] = R(lambda: f(k=True), ValueError, "k must be an int in \\[1, 6\\], got bool")
        cases["out_of_range"] = R(lambda: f(k=7), ValueError, "k must be an int in \\[1, 6\\], got int 7")
    return cases


def _rope() -> dict[str, Any]:
    r = kernels.RotaryEmbedding
    x = torch.randn(1, 2, 3, 8)

    def bounded() -> bool:
        rope = r(8, max_seq_len=16, cache_limit=64)
        far = rope(x, positions=torch.tensor([0, 5, 2**20]))
        wide = r(8, max_seq_len=2**20 + 1)(x, positions=torch.tensor([0, 5, 2**20]))
        return rope.max_seq_len <= 64 and torch.equal(far, wide)

    return {
        "non_tensor": R(lambda: r(8)(x.tolist()), TypeError, "x must be a torch.Tensor"),
        "wrong_rank": R(lambda: r(8)(x[0]), ValueError, r"x must be .*\(B, H, S, D\)"),
        "wrong_dtype": R(lambda: r(8)(x, positions=torch.tensor([0.0, 1.0, 2.0])), TypeError,
                              "positions must be one of"),
        "wrong_device": R(lambda: r(8)(x.to(OTHER)), ValueError, "x is on meta, the embedding's cache on cpu"),
        "empty": D(lambda: r(8)(x[:, :, :0]), lambda out: out.shape == (1, 2, 0, 8), kernels.RopeSelfAttention,
                            "S = 0 gives an empty output"),
        "nan": D(lambda: r(8)(_with(x, math.nan)), _has_nonfinite, r, "NaN or inf in x propagate"),
        "inf": R(lambda: r(8, base=math.inf), ValueError, "base must be a finite number > 1"),
        "bool_for_int": R(lambda: r(8)(x, offset=True), ValueError, "offset must be an int >= 0, got bool"),
        "out_of_range": D(bounded, lambda ok: ok, kernels.rope, "up to ``cache_limit`` positions"),
        "unowned_parameters": NA("has no trainable parameters"),
    }


def _rope_attention() -> dict[str, Any]:
    f, r = kernels.rope_attention, kernels.RotaryEmbedding(8)
    q = torch.randn(1, 2, 3, 8)
    return {
        "non_tensor": R(lambda: f(q.tolist(), q, q, r), TypeError, "q must be a torch.Tensor"),
        "wrong_rank": R(lambda: f(q[0], q, q, r), ValueError, r"q must be .*\(B, H, S, D\)"),
        "wrong_dtype": R(lambda: f(q, q, q, r, attn_mask=torch.ones(3, 3, dtype=torch.int64)), TypeError,
                              "attn_mask must be bool"),
        "wrong_device": R(lambda: f(q, q.to(OTHER), q, r), ValueError, "q, k, v must share dtype and device"),
        "empty": D(lambda: f(q[:, :, :0], q[:, :, :0], q[:, :, :0], r), lambda o: o.shape == (1, 2, 0, 8),
                            kernels.RopeSelfAttention, "S = 0 gives an empty output"),
        "nan": D(lambda: f(_with(q, math.nan), q, q, r), _has_nonfinite, f, "NaN or inf in q, k or v propagate"),
        "inf": D(lambda: f(q, q, _with(q, math.inf), r), _has_nonfinite, f, "NaN or inf in q, k or v propagate"),
        "bool_for_int": R(lambda: f(q, q, q, r, offset=True), ValueError, "offset must be an int >= 0, got bool"),
        "out_of_range": R(lambda: f(q, torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8), r), ValueError,
                               r"kv heads \(3\) must divide q heads \(2\)"),
        "unowned_parameters": NA("has no trainable parameters (rope's tables are buffers)"),
    }


def _rope_self_attention() -> dict[str, Any]:
    m = kernels.RopeSelfAttention
    x = torch.randn(2, 3, 8)
    return {
        "non_tensor": R(lambda: m(8, 2)(x.tolist()), TypeError, "x must be a torch.Tensor"),
        "wrong_rank": R(lambda: m(8, 2)(x[0]), ValueError, r"x must be .*\(B, S, dim=8\)"),
        "wrong_dtype": R(lambda: m(8, 2)(x.long()), TypeError, "x must be a floating"),
        "wrong_device": R(lambda: m(8, 2)(x.to(OTHER)), ValueError, "x on meta; the module's weights on cpu"),
        "empty": D(lambda: m(8, 2)(x[:, :0]), lambda o: o.shape == (2, 0, 8), m, "S = 0 gives an empty output"),
        "nan": D(lambda: m(8, 2)(_with(x, math.nan)), _has_nonfinite, m, "NaN or\n    inf in x propagate"),
        "inf": R(lambda: m(8, 2, base=math.inf), ValueError, "base must be a finite number > 1"),
        "bool_for_int": R(lambda: m(8, True), ValueError, "n_heads must be an int >= 1, got bool"),
        "out_of_range": R(lambda: m(8, 3), ValueError, r"n_heads \(3\) must divide dim \(8\)"),
        "unowned_parameters": NA("a module: its parameters are its own"),
    }


def _spectral(name: str) -> dict[str, Any]:
    a = torch.randn(20, 30)
    if name == "topk_singular_values":
        f = kernels.topk_singular_values
        k_bad, k_range = (lambda: f(a, True)), (lambda: f(a, 21))
        range_msg = r"k must be an int in \[1, 20\], got int 21"
        empty = R(lambda: f(a[:0], 1), ValueError, r"k must be an int in \[1, 0\]")
    else:
        f = kernels.spectral_features
        k_bad, k_range = (lambda: f(a, True)), (lambda: f(a, 1))
        range_msg = "k must be an int >= 2, got int 1"
        empty = R(lambda: f([]), ValueError, "weights is an empty list")
    k = 2 if name == "topk_singular_values" else 10
    # spectral_features reads a list as its layers: a nested list is a list of non-tensor layers
    listed = ("A must be a torch.Tensor" if name == "topk_singular_values"
              else r"weights\[0\] is a list, not a tensor: pass weights as a \(\.\.\., m, n\) tensor")
    return {
        "non_tensor": R(lambda: f(a.tolist(), k), TypeError, listed),
        "wrong_rank": R(lambda: f(a[0], k), ValueError, r"A must be .*\(\.\.\., m, n\)"),
        "wrong_dtype": R(lambda: f(a.long(), k), TypeError, "A must be a floating"),
        "wrong_device": NA("one tensor argument: computed on its own device"),
        "empty": empty,
        "nan": R(lambda: f(_with(a, math.nan), k), ValueError, "NaN or inf in A"),
        "inf": R(lambda: f(_with(a, -math.inf), k), ValueError, "NaN or inf in A"),
        "bool_for_int": R(k_bad, ValueError, "k must be an int .*got bool"),
        "out_of_range": R(k_range, ValueError, range_msg),
        "unowned_parameters": NA("no model or optimizer"),
    }


def _hypergradient() -> dict[str, Any]:
    f = kernels.darts_hypergradient

    def call(**kw):  # noqa: ANN003, ANN202
        model, inner, outer, w, theta, lr = problem()
        args = {"inner": model, "inner_loss": inner, "outer_loss": outer, "outer_params": list(w.parameters()),
                "lr": lr, "at": theta, **kw}
        if callable(args["outer_params"]):
            args["outer_params"] = args["outer_params"](w)
        if callable(args["at"]) and not isinstance(args["at"], dict):
            args["at"] = args["at"](theta)
        return f(**args)

    return {
        "non_tensor": R(lambda: call(outer_params=[1.0]), ValueError, "outer_params must be a non-empty iterable"),
        "wrong_rank": R(lambda: call(at=lambda t: {n: v.flatten() for n, v in t.items()}), ValueError,
                             r"at\[.*\] must match the parameter's shape"),
        "wrong_dtype": R(lambda: call(autocast_dtype=torch.float16), ValueError, "autocast_dtype must be None"),
        "wrong_device": R(lambda: call(outer_params=lambda w: [p.detach().to(OTHER).requires_grad_()
                                                                    for p in w.parameters()]),
                               ValueError, "on meta: move them to one device"),
        "empty": R(lambda: call(outer_loss=[]), ValueError, "outer_loss must be a loss closure"),
        "nan": R(lambda: call(outer_loss=lambda fwd: fwd(torch.full((4, 5), math.nan, dtype=torch.float64)).sum()),
                      FloatingPointError, "v is not finite"),
        "inf": R(lambda: call(lr=math.inf), ValueError, "lr must be a finite number > 0, got float inf"),
        "bool_for_int": R(lambda: call(lr=True), ValueError, "lr must be a finite number > 0, got bool"),
        "out_of_range": R(lambda: call(alpha=0.0), ValueError, "alpha must be a finite number > 0"),
        "unowned_parameters": R(lambda: call(at={"other.weight": torch.zeros(1)}), ValueError,
                                     "at is missing inner parameters"),
    }


def _reweighted_loss() -> dict[str, Any]:
    f = kernels.reweighted_loss
    losses = torch.rand(8)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1), nn.Sigmoid())

    return {
        "non_tensor": R(lambda: f(losses.tolist(), net()), TypeError, "losses must be a torch.Tensor"),
        "wrong_rank": R(lambda: f(losses[None], net()), ValueError, r"losses must be a tensor of shape \(B,\)"),
        "wrong_dtype": R(lambda: f(losses.long(), net()), TypeError, "losses must be a floating"),
        "wrong_device": R(lambda: f(losses, net().to(OTHER)), ValueError, "move them to one device"),
        "empty": R(lambda: f(losses[:0], net()), ValueError, "losses is empty"),
        "nan": D(lambda: f(_with(losses, math.nan), net()), _has_nonfinite, f, "NaN losses propagate"),
        "inf": D(lambda: f(_with(losses, math.inf), net()), _has_nonfinite, f, "NaN losses propagate"),
        "bool_for_int": NA("no int or flag argument"),
        "out_of_range": R(lambda: f(losses, net(), weight_inputs=torch.rand(7)), ValueError,
                               "weight_inputs must match losses"),
        "unowned_parameters": NA("weight_net's own parameters are the ones used"),
    }


def _deterministic() -> dict[str, Any]:
    def enter(**kw):  # noqa: ANN003, ANN202
        with kernels.deterministic(**kw):
            pass

    na = NA("takes a seed and a flag, no tensor")
    return {
        "non_tensor": na, "wrong_rank": na, "wrong_dtype": na, "wrong_device": na, "empty": na, "nan": na,
        "inf": R(lambda: enter(seed=math.inf), ValueError, r"seed must be an int in \[0, 4294967295\]"),
        "bool_for_int": R(lambda: enter(seed=True), ValueError, "seed must be an int .*got bool"),
        "out_of_range": R(lambda: enter(seed=-1), ValueError, r"seed must be an int in \[0, 4294967295\]"),
        "unowned_parameters": NA("no model or optimizer"),
    }


def _seed_worker() -> dict[str, Any]:
    na = NA("takes a DataLoader worker id, no tensor")
    return {
        **dict.fromkeys(("non_tensor", "wrong_rank", "wrong_dtype", "wrong_device", "empty", "nan", "inf"), na),
        "bool_for_int": R(lambda: kernels.seed_worker(True), ValueError, "worker_id must be an int >= 0"),
        "out_of_range": R(lambda: kernels.seed_worker(-1), ValueError, "worker_id must be an int >= 0"),
        "unowned_parameters": NA("no model or optimizer"),
    }


def _table() -> dict[str, dict[str, Any]]:
    per_sample = ("per_sample_grads", "per_sample_grad_gram", "per_sample_grad_norms")
    table = {name: _per_sample(name) for name in per_sample}
    table.update({name: _ocs(name) for name in ("ocs_scores", "ocs_select")})
    table.update({name: _spectral(name) for name in ("topk_singular_values", "spectral_features")})
    table.update(RotaryEmbedding=_rope(), rope_attention=_rope_attention(),
                 RopeSelfAttention=_rope_self_attention(), darts_hypergradient=_hypergradient(),
                 reweighted_loss=_reweighted_loss(), deterministic=_deterministic(), seed_worker=_seed_worker())
    table.update(_engine_table())
    return table


def _optimizers() -> dict[str, dict[str, Any]]:
    def params() -> list[torch.Tensor]:
        return list(_mlp().parameters())

    rows = {}
    for name in ("adamw", "sgd"):
        f = getattr(kernels, name)
        rows[name] = {
            "non_tensor": R(lambda f=f: f([1.0]), TypeError, "params holds a float, not a tensor"),
            "wrong_rank": NA("parameters of any shape are optimized"),
            "wrong_dtype": R(lambda f=f: f([torch.zeros(3, dtype=torch.int64)]), TypeError,
                             "params holds a torch.int64 tensor"),
            "wrong_device": NA("parameters on several devices are allowed: torch steps each device's group "
                               "(fused is chosen only for one device)"),
            "empty": R(lambda f=f: f([]), ValueError, "params is empty"),
            "nan": R(lambda f=f: f(params(), lr=math.nan), ValueError,
                     "lr must be a finite number >= 0, got float nan"),
            "inf": R(lambda f=f: f([{"params": params(), "lr": math.inf}]), ValueError,
                     r"params\[0\]\['lr'\] must be a finite number >= 0, got float inf"),
            "bool_for_int": R(lambda f=f: f(params(), lr=True), ValueError,
                              "lr must be a finite number >= 0, got bool"),
            "out_of_range": R(lambda f=f: f(params(), weight_decay=-1.0), ValueError,
                              "weight_decay must be a finite number >= 0"),
            "unowned_parameters": NA("an optimizer owns what it is given; train() checks it against the model"),
        }
    rows["adamw"]["out_of_range"] = R(lambda: kernels.adamw(params(), betas=(1.5, 0.9)), ValueError,
                                      r"betas\[0\] must be a finite number in \[0, 1\), got float 1.5")
    rows["sgd"]["bool_for_int"] = R(lambda: kernels.sgd(params(), nesterov=1), TypeError,
                                    "nesterov must be True or False, got int 1")
    return rows


def _train() -> dict[str, Any]:
    x, y = _batch()

    def run(batches: Any = None, opt_model: nn.Module | None = None, **kw: Any) -> Any:
        model = _mlp()
        opt = kernels.sgd((opt_model or model).parameters(), lr=0.1)
        return kernels.train(model, ce, opt, [(x, y)] if batches is None else batches, **kw)

    theirs = NA("the model's and the loss's own errors come through (train passes each batch to them unchanged)")
    return {
        "non_tensor": R(lambda: run([(x.tolist(), y)]), TypeError, "batch 0's inputs must be a torch.Tensor"),
        "wrong_rank": theirs,
        "wrong_dtype": R(lambda: run(recipe=kernels.Recipe(autocast_dtype=torch.float64)), ValueError,
                         "autocast_dtype must be one of"),
        "wrong_device": R(lambda: run(device=OTHER), ValueError, "parameters are on cpu but device='meta'"),
        "empty": D(lambda: run([]), lambda r: r.optimizer_steps == 0 and r.losses == [], kernels.train,
                   "An empty ``batches`` trains nothing"),
        "nan": R(lambda: run([(_with(x, math.nan), y)]), FloatingPointError,
                 "loss nan is not finite at optimizer step 1"),
        "inf": R(lambda: run(max_grad_norm=math.inf), ValueError, "max_grad_norm .* must be a finite number > 0"),
        "bool_for_int": R(lambda: run(recipe=kernels.Recipe(accumulation=True)), ValueError,
                          "accumulation must be an int >= 1, got bool"),
        "out_of_range": R(lambda: run(max_grad_norm=0.0), ValueError,
                          "max_grad_norm .* must be a finite number > 0"),
        "unowned_parameters": R(lambda: run(opt_model=_mlp()), ValueError,
                                "the optimizer holds 4 of its 4 parameters that are not the model's"),
    }


def _checkpoints(tmp: Path) -> dict[str, dict[str, Any]]:
    def saved() -> tuple[nn.Module, Path]:
        model, path = _mlp(), tmp / f"ck{len(list(tmp.iterdir()))}.safetensors"
        kernels.save_checkpoint(path, model, kernels.sgd(model.parameters()))
        return model, path

    def save(**kw: Any) -> None:
        model = _mlp()
        kernels.save_checkpoint(tmp / "s.safetensors", model, kernels.sgd(model.parameters()), **kw)

    def load(path: Path, model: nn.Module | None = None) -> int:
        model = model or _mlp()
        return kernels.load_checkpoint(path, model, kernels.sgd(model.parameters()))

    def garbage() -> Path:
        path = tmp / "garbage.safetensors"
        path.write_bytes(b"garbage")
        return path

    none = NA("no tensor argument: the model's and optimizer's state is what is saved")
    return {
        "save_checkpoint": {
            "non_tensor": R(lambda: kernels.save_checkpoint(tmp / "x", lambda: 0, None), TypeError,
                            "model must be a torch.nn.Module"),
            "wrong_rank": none, "wrong_dtype": none, "wrong_device": none, "nan": none, "inf": none,
            "empty": NA("a model without parameters is saved as such"),
            "bool_for_int": R(lambda: save(step=True), ValueError, "step must be an int >= 0, got bool"),
            "out_of_range": R(lambda: save(step=-1), ValueError, "step must be an int >= 0, got int -1"),
            "unowned_parameters": NA("saves what it is given; load_checkpoint checks the model it loads into"),
        },
        "load_checkpoint": {
            "non_tensor": R(lambda: load(garbage()), ValueError, "is not a readable safetensors file"),
            "wrong_rank": R(lambda: load(saved()[1], MLP((4, 6, 3))), RuntimeError,
                            "size mismatch for net.0.weight"),
            "wrong_dtype": none, "wrong_device": NA("tensors are read to the CPU, then loaded where the model is"),
            "nan": none, "inf": none, "bool_for_int": none,
            "empty": R(lambda: load(tmp / "missing.safetensors"), FileNotFoundError, "missing.safetensors"),
            "out_of_range": NA("no numeric argument"),
            "unowned_parameters": R(lambda: load(saved()[1], MLP((4, 5, 5, 3))), RuntimeError, "Missing key"),
        },
    }


def _recipe() -> dict[str, Any]:
    r = kernels.Recipe
    none = NA("a configuration of flags and counts, no tensor")
    return {
        "non_tensor": none, "wrong_rank": none, "wrong_device": none, "empty": none, "nan": none,
        "wrong_dtype": R(lambda: r(autocast_dtype=torch.float64), ValueError, "autocast_dtype must be one of"),
        "inf": R(lambda: r(accumulation=math.inf), ValueError, "accumulation must be an int >= 1, got float inf"),
        "bool_for_int": R(lambda: r(accumulation=True), ValueError, "accumulation must be an int >= 1, got bool"),
        "out_of_range": R(lambda: r(accumulation=0), ValueError, "accumulation must be an int >= 1, got int 0"),
        "unowned_parameters": NA("no model or optimizer"),
    }


def _standardizer() -> dict[str, Any]:
    s, x = kernels.Standardizer, torch.randn(5, 2)
    return {
        "non_tensor": R(lambda: s().fit(x.tolist()), TypeError, "X must be a torch.Tensor"),
        "wrong_rank": R(lambda: s().fit(x[0]), ValueError, r"X must be a tensor of shape \(N, D\)"),
        "wrong_dtype": R(lambda: s().fit(x.long()), TypeError, "X must be a floating-point tensor"),
        "wrong_device": R(lambda: s().fit(x).transform(x.to(OTHER)), ValueError,
                          "X on meta; the fitted statistics on cpu"),
        "empty": R(lambda: s().fit(x[:, :0]), ValueError, r"X is empty \(shape \(5, 0\)\)"),
        "nan": R(lambda: s().fit(_with(x, math.nan)), ValueError, "NaN or inf in X"),
        "inf": R(lambda: s().fit(x).transform(_with(x, math.inf)), ValueError, "NaN or inf in X"),
        "bool_for_int": NA("no int or flag argument"),
        "out_of_range": R(lambda: s().fit(x).transform(torch.randn(5, 3)), ValueError, "X has 3 features"),
        "unowned_parameters": NA("no model or optimizer"),
    }


def _feature_cache(tmp: Path) -> dict[str, Any]:
    def get(result: Any, key: Any = None) -> Any:
        return kernels.FeatureCache(tmp).get_or_compute({"k": 1} if key is None else key, lambda: result)

    return {
        "non_tensor": R(lambda: get({"f": [1.0]}), TypeError,
                        r"compute\(\)'s result must be a dict\[str, Tensor\]"),
        "wrong_rank": NA("tensors of any shape are stored"),
        "wrong_dtype": R(lambda: get({"f": torch.zeros(2, dtype=torch.complex128)}), TypeError,
                         "'f' is a torch.complex128 tensor"),
        "wrong_device": R(lambda: get({"f": torch.zeros(2, device=OTHER)}), TypeError, "'f' is a meta tensor"),
        "empty": R(lambda: kernels.FeatureCache(""), ValueError, "directory is empty"),
        "nan": D(lambda: get({"f": torch.tensor([math.nan])}, {"k": "nan"}), lambda r: bool(r["f"].isnan().all()),
                 kernels.feature_cache, "NaN and inf included"),
        "inf": D(lambda: get({"f": torch.tensor([math.inf])}, {"k": "inf"}), lambda r: bool(r["f"].isinf().all()),
                 kernels.feature_cache, "NaN and inf included"),
        "bool_for_int": NA("no int argument (a key's bool and int hash apart, each tagged with its type)"),
        "out_of_range": R(lambda: get({"f": torch.zeros(1)}, {"k": object()}), TypeError,
                          "key k is a object: use tensors, None, bool, int, float, str"),
        "unowned_parameters": NA("no model or optimizer"),
    }


_TMP = tempfile.TemporaryDirectory(prefix="kernelgate-bad-input-")  # removed at exit


def _engine_table() -> dict[str, dict[str, Any]]:
    tmp = Path(_TMP.name)
    return {**_optimizers(), "train": _train(), **_checkpoints(tmp), "Recipe": _recipe(),
            "Standardizer": _standardizer(), "FeatureCache": _feature_cache(tmp)}


TABLE = _table()
CASES = [(name, cls) for name in sorted(TABLE) for cls in CLASSES if not isinstance(TABLE[name].get(cls), NA)]


def test_every_public_name_meets_every_class() -> None:
    assert sorted(TABLE) == sorted(kernels.__all__), "a public name without its row of bad inputs, or a stale row"
    for name, row in TABLE.items():
        assert set(row) == set(CLASSES), f"{name}: classes {sorted(set(CLASSES) ^ set(row))} missing or unknown"
        for cls, case in row.items():
            assert isinstance(case, Raises | Documented | NA), (name, cls)
            assert not isinstance(case, NA) or len(case.why) >= 10, f"{name}/{cls}: say why it does not apply"


@pytest.mark.parametrize(("name", "cls"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_bad_input_is_refused_or_documented(name: str, cls: str) -> None:
    case = TABLE[name][cls]
    if isinstance(case, Raises):
        with pytest.raises(case.exc, match=case.match):
            case.call()
        return
    assert case.phrase in (case.where.__doc__ or ""), f"{name}/{cls}: the outcome is not documented"
    assert case.check(case.call()), f"{name}/{cls}: not the documented outcome"


# The validators themselves.

@pytest.mark.parametrize("value", [3, np.int64(3), torch.tensor(3)])
def test_integer_takes_integer_scalars(value: Any) -> None:
    got = checks.integer(value, "n", low=1, high=3)
    assert got == 3 and type(got) is int  # a Python int, not the scalar (a tensor == 3 is a tensor)


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None, torch.tensor(2.0), np.float32(2), np.True_,
                                   torch.tensor(True)])
def test_integer_refuses_bools_floats_and_strings(value: Any) -> None:
    with pytest.raises(ValueError, match="n must be an int >= 0, got "):
        checks.integer(value, "n", low=0)


@pytest.mark.parametrize(("value", "kw"), [(math.nan, {}), (math.inf, {}), (-math.inf, {}), (True, {}), ("1", {}),
                                            (0.0, {"low": 0, "low_open": True}), (1.5, {"high": 1}),
                                            (1.0, {"low": 0, "high": 1, "high_open": True}),
                                            (torch.tensor([1.0, 2.0]), {}), (None, {}), (np.True_, {}),
                                            (np.complex128(1 + 2j), {}), (1 + 0j, {}), (b"1.5", {}),
                                            (np.complex64(1 + 2j), {}), (10**400, {}), (torch.tensor(True), {})])
def test_number_refuses_nonfinite_bools_and_out_of_range(value: Any, kw: dict) -> None:
    """numpy's bool, numpy's complex (float() dropped its imaginary part; complex64 is no Python
    complex), bytes, an int past
    float's range (an OverflowError naming nothing) and a one-element bool tensor among them."""
    with pytest.raises(ValueError, match="x must be a finite number"):
        checks.number(value, "x", **kw)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float32, torch.bfloat16, torch.float64)])
def test_nonfinite_names_exactly_the_tensors_holding_nan_or_inf(bad: float, dtypes: tuple) -> None:
    named = {f"t{i}": torch.randn(5, 3).to(d) for i, d in enumerate(dtypes)}
    named["ids"] = torch.arange(4)  # integers: finite by type
    assert checks.nonfinite(named) == []
    for i in (2, 0):  # one, then two tensors spoiled, each at one element
        named[f"t{i}"][4 - i, 1] = bad
        assert checks.nonfinite(named) == [f"t{j}" for j in (0, 2) if j >= i]


def test_extremes_of_mixed_dtypes_are_read_in_float64() -> None:
    """Tensors of several dtypes meet in float64: a finite float64 value past float32's range is
    neither inf nor flushed to 0, and each pair is (min, max)."""
    named = {"a": torch.tensor([-2.0, 3.0]), "b": torch.tensor([1e300, -1e-300], dtype=torch.float64)}
    assert checks.extremes(named) == {"a": (-2.0, 3.0), "b": (-1e-300, 1e300)}
    assert checks.nonfinite(named) == []


def test_overlapping_sees_storages_over_one_buffer() -> None:
    """Views of one storage and two storages over overlapping parts of one numpy buffer meet;
    neighbouring slices and empty tensors do not."""
    buffer = np.zeros(100, dtype=np.float32)
    base = torch.zeros(10)
    apart = {"a": torch.from_numpy(buffer[:50]), "b": torch.from_numpy(buffer[50:]), "none": torch.empty(0),
             "other": torch.zeros(3)}
    assert checks.overlapping(apart) is None
    assert checks.overlapping({**apart, "c": torch.from_numpy(buffer[40:60])}) == ("a", "c")
    assert checks.overlapping({"x": base[:2], "y": base[5:]}) == ("x", "y")  # one storage: its whole span


def test_writable_refuses_autograd_history_and_inference_tensors_outside_inference_mode() -> None:
    checks.writable(torch.zeros(2), "out")
    with pytest.raises(ValueError, match="out requires grad"):
        checks.writable(torch.zeros(2, requires_grad=True), "out")
    with torch.inference_mode():
        made = torch.zeros(2)
        checks.writable(made, "out")  # written where it was made
    with pytest.raises(ValueError, match="out is an inference tensor"):
        checks.writable(made, "out")


def test_number_takes_numpy_and_one_element_tensors() -> None:
    assert checks.number(np.float32(0.5), "x", low=0) == 0.5
    assert checks.number(torch.tensor(0.25), "x") == 0.25
    assert checks.number(3, "x", low=0, low_open=True) == 3.0


def test_flag_and_choice() -> None:
    assert checks.flag(False, "f") is False
    with pytest.raises(TypeError, match="f must be True or False, got int 1"):
        checks.flag(1, "f")
    assert checks.choice("a", "c", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"c must be one of \(0, 1\), got bool True"):
        checks.choice(True, "c", (0, 1))  # True == 1, but a bool is not a choice of ints
    for value, options in ((np.True_, (0, 1)), (1, (True, False)), (torch.tensor(1), (1, 2))):
        with pytest.raises(ValueError, match="c must be one of"):
            checks.choice(value, "c", options)


def test_finite_names_the_first_bad_tensor_in_one_pass() -> None:
    good, bad = torch.randn(3, 4), _with(torch.randn(3, 4), math.nan)
    checks.finite({"a": good, "ids": torch.arange(3), "none": torch.empty(0)})
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="NaN or inf in b; fix it"):
            checks.finite({"a": good, "b": _with(good, value), "c": bad}, hint="fix it")
    with pytest.raises(FloatingPointError, match="NaN or inf in h"):
        checks.finite({"h": bad.to(torch.bfloat16)}, error=FloatingPointError)


def test_nonfinite_reads_again_only_what_a_sum_flags() -> None:
    """A sum that overflows on finite values (3e38 twice in float32, 6e4 twice in float16, whose
    float32 sum does not) is read again exactly and found finite; a NaN, or infs of both signs
    (a NaN sum), are named."""
    big = {"f32": torch.tensor([3e38, 3e38]), "f16": torch.tensor([6e4, 6e4], dtype=torch.float16),
           "bf16": torch.tensor([3e38, 3e38], dtype=torch.bfloat16)}
    assert checks.nonfinite(big) == []
    checks.finite(big)
    both = torch.tensor([math.inf, -math.inf, 1.0])
    assert checks.nonfinite({**big, "both": both, "nan": torch.tensor([math.nan])}) == ["both", "nan"]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
def test_finite_reads_complex_float8_and_compressed_sparse_tensors() -> None:
    """A complex tensor by its real and imaginary parts (a NaN passed as 'finite by type' before,
    and a complex parameter stepped to NaN silently), float8 through float32 (aminmax has no
    float8 kernel), a CSR tensor by its stored values."""
    z = torch.zeros(3, dtype=torch.complex64)
    assert checks.nonfinite({"z": z, "zc": z.conj()}) == []
    for bad in (complex(math.nan, 0), complex(0, math.inf)):
        assert checks.nonfinite({"z": _with(z, bad), "zc": _with(z, bad).conj()}) == ["z", "zc"]
    f8 = torch.ones(4).to(torch.float8_e4m3fn)
    assert checks.nonfinite({"f8": f8}) == []
    assert checks.nonfinite({"f8": _with(torch.ones(4), math.nan).to(torch.float8_e4m3fn)}) == ["f8"]
    # an uncoalesced COO tensor (a sparse embedding's gradient) holds the sum of its duplicates: inf here
    twice = torch.sparse_coo_tensor([[0, 0]], [3e38, 3e38], (2,), check_invariants=True)
    assert checks.nonfinite({"coo": twice}) == ["coo"]
    csr = torch.eye(3).to_sparse_csr()
    assert checks.nonfinite({"csr": csr}) == []
    assert checks.nonfinite({"csr": _with(torch.eye(3), math.nan).to_sparse_csr()}) == ["csr"]
    with pytest.raises(ValueError, match="at least one tensor"):
        checks.same_device({})


def test_same_device_lists_each_device_once() -> None:
    named = {f"p{i}": torch.zeros(1) for i in range(5)} | {"q": torch.zeros(1, device=OTHER)}
    with pytest.raises(ValueError, match=r"p0 \(and 4 more\) on cpu; q on meta: move them to one device"):
        checks.same_device(named)


def test_tensor_checks_rank_dtype_and_emptiness() -> None:
    with pytest.raises(ValueError, match=r"x must be a tensor with 2 or 3 dims, got shape \(4,\)"):
        checks.tensor(torch.zeros(4), "x", ndim=(2, 3))
    with pytest.raises(TypeError, match="x must be one of"):
        checks.tensor(torch.zeros(4), "x", dtypes=(torch.int64,))
    with pytest.raises(ValueError, match=r"x is empty \(shape \(0, 2\)\)"):
        checks.tensor(torch.zeros(0, 2), "x", nonempty=True)
    for sparse in (torch.eye(3).to_sparse(), torch.eye(3).to_sparse_csr()):
        with pytest.raises(TypeError, match=r"x must be a dense tensor, got layout torch.sparse_\w+; pass "
                                            r"x.to_dense"):
            checks.tensor(sparse, "x")


def test_no_module_reimplements_a_validator() -> None:
    """One set of validators: kernels' modules call kernels.checks, not isfinite().all() or
    hand-written bool-excluding int checks of their own."""
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        text = path.read_text()
        if path.name == "checks.py":
            continue
        assert "torch.isfinite(" not in text, f"{path.name}: use checks.finite or checks.nonfinite"
        hand_made = re.search(r"isinstance\(\w+, bool\) or not isinstance", text)
        assert not hand_made, f"{path.name}: use checks.integer"
