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
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

FORMAT = "kernelgate-feature-cache-1"


def _version() -> str:
    try:
        return metadata.version("kernelgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def _tensor_bytes(t: Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _plain(value: object, where: str) -> object:
    """A JSON-able canonical form of a plain key value, every value tagged with its type (so 1,
    1.0, True, "1", [1] and (1,) all differ; floats exactly, via float.hex)."""
    if value is None:
        return ["none"]
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


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """``tensors`` (CPU, contiguous, not sharing storage) and ``metadata`` plus the tensors'
    SHA-256 as ``path``, atomically: a temporary file in the same directory, then ``os.replace``
    (a reader sees the old file or the new one, never a half-written one)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(dict(tensors), tmp, metadata={**metadata, "sha256": _checksum(tensors)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata ``write_safetensors`` wrote; ValueError when the file does not
    parse or its tensors fail the recorded checksum (truncated, corrupted, edited)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - the caller decides what an unreadable file means
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    if meta.get("sha256") != _checksum(tensors):
        raise ValueError(f"{path} fails its checksum: corrupted or edited")
    return tensors, meta


class FeatureCache:
    """Tensors computed once per distinct input, kept in ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def path(self, key: Mapping[str, object]) -> Path:
        return self.directory / f"{key_hash(key)}.safetensors"

    def _load(self, path: Path, digest: str) -> dict[str, Tensor] | None:
        if not path.exists():
            return None
        try:
            tensors, meta = read_safetensors(path)
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
        """The tensors stored for ``key`` (on the CPU), else ``compute()``'s, stored then returned."""
        digest = key_hash(key)
        path = self.directory / f"{digest}.safetensors"
        cached = self._load(path, digest)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        out = compute()
        if not isinstance(out, Mapping) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                                   for k, v in out.items()):
            raise TypeError("compute() must return a dict[str, Tensor]")
        tensors = {k: v.detach().to("cpu").clone() for k, v in out.items()}  # own storage: views may share
        write_safetensors(path, tensors, {"format": FORMAT, "key": digest})
        return tensors
