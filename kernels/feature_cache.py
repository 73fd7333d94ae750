"""A content-addressed cache of computed tensors on disk: safetensors files, never pickle.

``FeatureCache(directory).get_or_compute(key, compute)`` hashes ``key`` (a dict of tensors, by
dtype, shape and bytes, and of plain values: None, bool, int, float, str and lists, tuples and
dicts of them, each tagged with its type) together with the library version and the cache
format, and returns the stored tensors for that hash or, on a miss, ``compute()``'s
``dict[str, Tensor]``, written atomically (a temporary file in the same directory, then
``os.replace``). Each file records its key hash and a SHA-256 of its tensors; a file that does
not parse, belongs to another key or fails the checksum (truncated, corrupted, edited) is
reported with a warning and recomputed. The checksum is not a signature: someone who rewrites
the file and its checksum together is not detected (that needs a secret, e.g. an HMAC key).
The library version of an editable install does not change with the code: callers whose
features depend on code they may edit put that in the key (the probe workload hashes the
sources it computes with).

Files get the permissions a plain ``open()`` would give them (0o666 less the umask), not the
0600 of a private temporary file. A finished ``compute()`` is never lost: when its result cannot
be written (disk full, read-only or vanished directory) it is returned with a warning naming the
path and the OSError. The cache stores exactly what ``compute()`` returned, as detached CPU
copies: NaN and inf included (what a value means is the caller's business, and refusing it here
would recompute it on every call). Refused, with an error naming the argument: a ``directory``
that is not a str or PathLike path, is empty, or is an existing file (``~`` is expanded); a
``compute`` that is not callable (also on a hit); a ``key`` that is not a non-empty dict with str
names, holds a tensor below its top level, a sparse or meta tensor, or any other value type; a
``compute()`` result that is not a flat dict[str, Tensor] of dense tensors of a dtype safetensors
stores, or names a tensor ``__metadata__`` (safetensors' header key: the file would not read back).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

FORMAT = "kernelgate-feature-cache-1"

# the dtypes safetensors stores (safetensors.torch's table, which is private)
_STORABLE = frozenset(
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool, torch.complex64]
    + [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                   "float8_e5m2fnuz") if hasattr(torch, n)])


def _version() -> str:
    try:
        return metadata.version("kernelgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def _tensor_bytes(t: Tensor) -> bytes:
    flat = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)  # a conj view: its values
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _plain(value: object, where: str) -> object:
    """A JSON-able canonical form of a plain key value, every value tagged with its type (so 1,
    1.0, True, "1", [1] and (1,) all differ; floats exactly, via float.hex)."""
    if value is None:
        return ["none"]
    if isinstance(value, Tensor):
        raise TypeError(f"key {where} is a tensor inside a list, tuple or dict: tensors are key values only "
                        "at the top level ({name: tensor})")
    for kind, cls in (("bool", bool), ("int", int), ("str", str)):
        if isinstance(value, cls):
            return [kind, value]
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, list | tuple):
        return [type(value).__name__, [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, Mapping):
        _names(value, where)
        return ["dict", [[k, _plain(value[k], f"{where}.{k}")] for k in sorted(value)]]
    raise TypeError(f"key {where} is a {type(value).__name__}: use tensors, None, bool, int, float, str, or "
                    "lists/tuples/dicts of them")


def _names(mapping: Mapping, where: str) -> None:
    if not all(isinstance(k, str) for k in mapping):
        kinds = sorted({type(k).__name__ for k in mapping})
        raise TypeError(f"key {where or 'names'}: dict keys must be str, got {kinds}")


def key_hash(key: Mapping[str, object]) -> str:
    """SHA-256 of the key's content, the library version and the cache format."""
    if not isinstance(key, Mapping) or not key:
        raise TypeError("key must be a non-empty dict of tensors and plain values")
    _names(key, "")
    h = hashlib.sha256(json.dumps([FORMAT, _version()]).encode())
    for name in sorted(key):
        value = key[name]
        h.update(json.dumps(name).encode())
        if isinstance(value, Tensor):
            if value.layout != torch.strided or value.is_meta:
                kind = "meta" if value.is_meta else value.layout
                raise TypeError(f"key {name} is a {kind} tensor: key tensors are hashed by their values, so "
                                "pass a dense one with data (.to_dense())")
            h.update(json.dumps(["tensor", str(value.dtype), list(value.shape)]).encode())
            h.update(_tensor_bytes(value))
        else:
            h.update(json.dumps(["plain", _plain(value, str(name))]).encode())
    return h.hexdigest()


def _checksum(tensors: Mapping[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _storable(tensors: Mapping[str, Tensor], what: str) -> None:
    """Each of ``tensors`` is one safetensors can store and read back, else an error naming it."""
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"{what} must be a dict[str, Tensor]: its key {name!r} is a {type(name).__name__}")
        if not isinstance(t, Tensor):
            nested = " (a flat dict: nest names as 'a/b' instead)" if isinstance(t, Mapping) else ""
            raise TypeError(f"{what} must be a dict[str, Tensor]: its {name!r} is a {type(t).__name__}{nested}")
        if name == "__metadata__":
            raise ValueError(f"{what} names a tensor '__metadata__', the safetensors header's own key: rename it")
        if t.layout != torch.strided or t.is_meta or t.dtype not in _STORABLE:
            kind = "meta" if t.is_meta else t.layout if t.layout != torch.strided else t.dtype
            raise TypeError(f"{what}'s {name!r} is a {kind} tensor: safetensors stores dense tensors with data, "
                            f"of {', '.join(sorted(str(d).removeprefix('torch.') for d in _STORABLE))}")


def _new_file(directory: Path) -> tuple[Path, int]:
    """An empty temporary file of our own in ``directory`` and its mode: created as a plain
    ``open()`` creates a file (0o666 less the umask, which os.umask cannot read without setting
    it for every thread), not mkstemp's 0600."""
    for _ in range(100):
        tmp = directory / f".tmp-{secrets.token_hex(8)}.safetensors"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(f"no free temporary file name in {directory}")


def _os_error(e: SafetensorError, path: Path) -> OSError | None:
    """safetensors' writer reports I/O failures (disk full, file too large) as SafetensorError
    ("... I/O error: No space left on device (os error 28)"): the OSError they are."""
    text = str(e)
    code = re.search(r"os error (\d+)", text)
    if code:
        return OSError(int(code[1]), os.strerror(int(code[1])), str(path))
    return OSError(f"{text} ({path})") if "I/O error" in text else None


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """``tensors`` (CPU, contiguous, not sharing storage) and ``metadata`` plus the tensors'
    SHA-256 as ``path``, atomically: a temporary file in the same directory, then ``os.replace``
    (a reader sees the old file or the new one, never a half-written one). The file gets the
    permissions ``open()`` would give it. Any failure to write is an OSError (the temporary file
    removed); tensors safetensors cannot store are refused before anything is written."""
    path = Path(path)
    _storable(tensors, "tensors")
    tmp, mode = _new_file(path.parent)
    try:
        try:
            save_file(dict(tensors), tmp, metadata={**metadata, "sha256": _checksum(tensors)})
        except SafetensorError as e:
            err = _os_error(e, tmp)
            if err is None:
                raise
            raise err from e
        os.chmod(tmp, mode)  # safetensors writes through a 0600 temporary file of its own, renamed onto tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata ``write_safetensors`` wrote; ValueError when the file does not
    parse or its tensors fail the recorded checksum (truncated, corrupted, edited)."""
    try:
        with safe_open(str(path), framework="pt") as f:  # one open: a file replaced meanwhile is not mixed in
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - the caller decides what an unreadable file means
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    if meta.get("sha256") != _checksum(tensors):
        raise ValueError(f"{path} fails its checksum: corrupted or edited")
    return tensors, meta


class FeatureCache:
    """Tensors computed once per distinct input, kept in ``directory`` (created if missing; a
    leading ``~`` is the user's home)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        if isinstance(directory, bytes) or not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a str or os.PathLike path, got {type(directory).__name__}")
        if not os.fspath(directory):
            raise ValueError("directory is empty: name the cache's folder ('.' for the current one)")
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"directory {self.directory} exists and is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def path(self, key: Mapping[str, object]) -> Path:
        return self.directory / f"{key_hash(key)}.safetensors"

    def _load(self, path: Path, digest: str) -> dict[str, Tensor] | None:
        try:
            tensors, meta = read_safetensors(path)
        except FileNotFoundError:  # never written, or removed since
            return None
        except ValueError as e:  # any unreadable file is recomputed, with a warning
            warnings.warn(f"feature cache file {path.name}: {e}; recomputing", stacklevel=3)
            return None
        if meta.get("format") != FORMAT or meta.get("key") != digest:
            warnings.warn(f"feature cache file {path.name} fails its key (corrupted or tampered with); "
                          "recomputing", stacklevel=3)
            return None
        return tensors

    def get_or_compute(self, key: Mapping[str, object],
                       compute: Callable[[], Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """The tensors stored for ``key`` (on the CPU), else ``compute()``'s (detached CPU copies,
        values exactly as computed), stored then returned; returned with a warning when they
        cannot be stored."""
        if not callable(compute):
            raise TypeError("compute must be a callable returning a dict[str, Tensor], got "
                            f"{type(compute).__name__}")
        digest = key_hash(key)
        path = self.directory / f"{digest}.safetensors"
        cached = self._load(path, digest)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        out = compute()
        if not isinstance(out, Mapping):
            raise TypeError(f"compute() must return a dict[str, Tensor], got {type(out).__name__}")
        _storable(out, "compute()'s result")
        # own storage (views may share one), row-major (safetensors stores no strides): a transposed
        # or channels_last result is stored as its values
        tensors = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in out.items()}
        try:
            write_safetensors(path, tensors, {"format": FORMAT, "key": digest})
        except OSError as e:  # the result is computed: return it rather than lose it
            warnings.warn(f"feature cache could not store {path} ({type(e).__name__}: {e}); returning the "
                          "computed tensors without caching them", stacklevel=2)
        return tensors
