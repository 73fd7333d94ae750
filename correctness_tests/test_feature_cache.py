"""kernels.FeatureCache: hits by content, misses on any change, atomic writes with open()'s
permissions, corrupted or tampered files detected and recomputed with a warning, a result that
cannot be written returned with a warning; never pickle; one test per refused input."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
import torch
from safetensors import SafetensorError

from kernels.feature_cache import FeatureCache, key_hash, write_safetensors


class Counter:
    def __init__(self, value: torch.Tensor) -> None:
        self.calls, self.value = 0, value

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"features": self.value * 2, "ids": torch.arange(3)}


def _key(w: torch.Tensor, k: int = 10) -> dict:
    return {"weights": w, "k": k, "settings": {"oversample": None, "niter": 4, "scale": 0.5}}


def test_hit_by_content_and_miss_on_any_change(tmp_path) -> None:
    cache, w = FeatureCache(tmp_path), torch.randn(4, 5)
    compute = Counter(w)
    first = cache.get_or_compute(_key(w), compute)
    again = cache.get_or_compute(_key(w.clone()), compute)  # same content, another tensor object
    assert compute.calls == 1 and (cache.hits, cache.misses) == (1, 1)
    assert all(torch.equal(first[n], again[n]) for n in first) and torch.equal(again["features"], w * 2)
    w2 = w.clone()
    w2[0, 0] += 1e-6
    for changed in (_key(w2), _key(w, k=11), _key(w.double()), _key(w.reshape(5, 4)),
                    {**_key(w), "settings": {"oversample": None, "niter": 4, "scale": 0.5000001}}):
        assert key_hash(changed) != key_hash(_key(w))
    cache.get_or_compute(_key(w2), compute)
    assert compute.calls == 2


def test_a_new_library_version_misses(tmp_path, monkeypatch) -> None:
    w = torch.randn(3)
    before = key_hash(_key(w))
    monkeypatch.setattr("kernels.feature_cache._version", lambda: "99.0")
    assert key_hash(_key(w)) != before


@pytest.mark.parametrize("damage", ["truncate", "flip_a_data_byte", "pickle_instead"])
def test_damaged_files_are_recomputed_with_a_warning(tmp_path, damage: str) -> None:
    cache, w = FeatureCache(tmp_path), torch.randn(64, 8)
    compute = Counter(w)
    cache.get_or_compute(_key(w), compute)
    path = cache.path(_key(w))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip_a_data_byte":
        path.write_bytes(raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:])
    else:
        path.write_bytes(pickle.dumps({"features": w * 3}))  # never unpickled
    with pytest.warns(UserWarning, match="recomputing"):
        out = cache.get_or_compute(_key(w), compute)
    assert compute.calls == 2 and torch.equal(out["features"], w * 2)
    assert torch.equal(cache.get_or_compute(_key(w), compute)["features"], w * 2) and compute.calls == 2


def test_a_failing_compute_leaves_no_file(tmp_path) -> None:
    cache = FeatureCache(tmp_path)

    def boom() -> dict:
        raise RuntimeError("compute failed")

    with pytest.raises(RuntimeError, match="compute failed"):
        cache.get_or_compute(_key(torch.ones(2)), boom)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match=r"compute\(\) must return a dict\[str, Tensor\], got list"):
        cache.get_or_compute(_key(torch.ones(2)), lambda: [torch.ones(1)])
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".safetensors" and not p.name.startswith(".tmp")]


def test_bad_keys_are_refused(tmp_path) -> None:
    cache = FeatureCache(tmp_path)
    with pytest.raises(TypeError, match="key settings.fn is a builtin_function_or_method"):
        cache.get_or_compute({"settings": {"fn": len}}, lambda: {})
    with pytest.raises(TypeError, match="non-empty dict"):
        cache.get_or_compute({}, lambda: {})


def test_distinct_keys_never_collide() -> None:
    """Every value carries its type: 1, 1.0, True, '1', [1], (1,) and {'a': 1} all differ."""
    values = [1, 1.0, True, "1", [1], (1,), {"a": 1}, None, [1, 2], (1, 2), 1.0000000000000002,
              {"float": (1.0).hex()}, torch.tensor(1), torch.tensor(1.0), torch.tensor([1])]
    hashes = {key_hash({"v": v}) for v in values}
    assert len(hashes) == len(values)
    assert key_hash({"a": 1, "b": 2}) != key_hash({"ab": 1, "": 2})
    with pytest.raises(TypeError, match="dict keys must be str"):
        key_hash({"settings": {1: "x"}})
    with pytest.raises(TypeError, match="dict keys must be str"):
        key_hash({1: "x"})


def test_outputs_that_share_memory_are_stored(tmp_path) -> None:
    base = torch.arange(10.0)
    out = FeatureCache(tmp_path).get_or_compute({"k": 1}, lambda: {"all": base, "head": base[:3]})
    assert torch.equal(out["head"], base[:3])
    again = FeatureCache(tmp_path).get_or_compute({"k": 1}, lambda: {})
    assert torch.equal(again["all"], base) and torch.equal(again["head"], base[:3])


def test_a_transposed_or_channels_last_result_is_stored_as_its_values(tmp_path) -> None:
    """safetensors stores no strides: a result laid out otherwise is stored row-major, not lost."""
    t, image = torch.randn(3, 4).t(), torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    cache = FeatureCache(tmp_path)
    out = cache.get_or_compute({"k": 1}, lambda: {"t": t, "image": image})
    assert torch.equal(out["t"], t) and torch.equal(out["image"], image)
    again = FeatureCache(tmp_path).get_or_compute({"k": 1}, lambda: {})
    assert torch.equal(again["t"], t) and torch.equal(again["image"], image)


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_get_the_permissions_open_would(tmp_path, umask: int, mode: int) -> None:
    """0o666 less the umask, like a file from open(): the cache is not private to its writer."""
    old = os.umask(umask)
    try:
        cache = FeatureCache(tmp_path / "cache")
        cache.get_or_compute({"k": 1}, lambda: {"x": torch.ones(3)})
        plain = tmp_path / "plain"
        plain.write_bytes(b"")
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.path({"k": 1}).stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == mode
    assert _files(tmp_path / "cache") == [cache.path({"k": 1}).name]


def test_a_failed_write_returns_the_result_with_a_warning(tmp_path, monkeypatch) -> None:
    """Disk full in the middle of the write (safetensors reports it as a SafetensorError): the
    computed tensors come back, with a warning naming the file and the OSError; no file is left;
    write_safetensors itself (checkpoints) raises the OSError."""
    def disk_full(*args, **kwargs) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("kernels.feature_cache.save_file", disk_full)
    cache, w = FeatureCache(tmp_path), torch.randn(4, 5)
    compute = Counter(w)
    with pytest.warns(UserWarning) as caught:
        out = cache.get_or_compute(_key(w), compute)
    message = str(caught[0].message)
    assert str(cache.path(_key(w))) in message and "No space left on device" in message, message
    assert torch.equal(out["features"], w * 2) and compute.calls == 1
    assert _files(tmp_path) == []
    with pytest.raises(OSError, match="No space left on device") as raised:
        write_safetensors(tmp_path / "ckpt.safetensors", {"x": torch.ones(2)}, {})
    assert raised.value.errno == 28 and _files(tmp_path) == []
    monkeypatch.undo()
    cache.get_or_compute(_key(w), compute)  # stored now; then a hit
    assert torch.equal(cache.get_or_compute(_key(w), compute)["features"], w * 2) and compute.calls == 2


def test_a_real_os_error_returns_the_result_with_a_warning(tmp_path) -> None:
    """A real failure that root cannot write past either: a directory where the file goes."""
    cache, w = FeatureCache(tmp_path), torch.randn(4, 5)
    cache.path(_key(w)).mkdir()
    with pytest.warns(UserWarning) as caught:  # the directory does not read, then does not write
        out = cache.get_or_compute(_key(w), Counter(w))
    stored = [str(c.message) for c in caught if "could not store" in str(c.message)]
    assert len(stored) == 1 and stored[0].startswith(f"feature cache could not store {cache.path(_key(w))} "
                                                     "(IsADirectoryError: "), stored
    assert torch.equal(out["features"], w * 2)
    assert _files(tmp_path) == [cache.path(_key(w)).name]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into a 0o500 directory regardless (the failure is simulated above)")
def test_a_read_only_directory_still_computes(tmp_path) -> None:
    cache, w = FeatureCache(tmp_path / "ro"), torch.randn(3)
    (tmp_path / "ro").chmod(0o500)
    try:
        with pytest.warns(UserWarning, match="could not store .*PermissionError"):
            out = cache.get_or_compute(_key(w), Counter(w))
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert torch.equal(out["features"], w * 2) and _files(tmp_path / "ro") == []


BAD_RESULTS = {
    "a nested dict": (lambda: {"x": {"y": torch.ones(2)}}, TypeError,
                      r"compute\(\)'s result must be a dict\[str, Tensor\]: its 'x' is a dict \(a flat dict"),
    "a float": (lambda: {"x": 1.0}, TypeError, "its 'x' is a float"),
    "an array": (lambda: {"x": [1.0, 2.0]}, TypeError, "its 'x' is a list"),
    "an int name": (lambda: {1: torch.ones(2)}, TypeError, "its key 1 is a int"),
    "sparse": (lambda: {"x": torch.eye(2).to_sparse()}, TypeError, "'x' is a torch.sparse_coo tensor"),
    "meta": (lambda: {"x": torch.ones(2, device="meta")}, TypeError, "'x' is a meta tensor"),
    "complex128": (lambda: {"x": torch.ones(2, dtype=torch.complex128)}, TypeError,
                   "'x' is a torch.complex128 tensor: safetensors stores"),
    "__metadata__": (lambda: {"__metadata__": torch.ones(2)}, ValueError,
                     "'__metadata__', the safetensors header"),
}


@pytest.mark.parametrize("case", list(BAD_RESULTS))
def test_a_bad_compute_result_is_refused_and_nothing_written(tmp_path, case: str) -> None:
    compute, error, message = BAD_RESULTS[case]
    cache = FeatureCache(tmp_path)
    with pytest.raises(error, match=message):
        cache.get_or_compute({"k": 1}, compute)
    assert _files(tmp_path) == []


def test_compute_that_is_not_callable_is_refused_on_a_hit_too(tmp_path) -> None:
    cache = FeatureCache(tmp_path)
    cache.get_or_compute({"k": 1}, lambda: {"x": torch.ones(2)})
    for compute in (None, {"x": torch.ones(2)}):
        with pytest.raises(TypeError, match="compute must be a callable returning a dict"):
            cache.get_or_compute({"k": 1}, compute)


@pytest.mark.parametrize("directory", [None, b"cache", 3])
def test_a_directory_that_is_not_a_path_is_refused(directory) -> None:
    with pytest.raises(TypeError, match="directory must be a str or os.PathLike path"):
        FeatureCache(directory)


def test_an_empty_directory_name_is_refused(tmp_path, monkeypatch) -> None:
    """'' would have been the current directory, silently."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="directory is empty"):
        FeatureCache("")
    assert _files(tmp_path) == []


def test_a_directory_that_is_a_file_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        FeatureCache(tmp_path / "file")


def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch) -> None:
    """The documented FeatureCache("~/.cache/probe") made a folder named '~' in the cwd."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cache = FeatureCache("~/probe")
    assert cache.directory == tmp_path / "home" / "probe" and cache.directory.is_dir()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize(("key", "message"), [
    ({"w": [torch.ones(2)]}, r"key w\[0\] is a tensor inside a list, tuple or dict: tensors are key values only"),
    ({"s": {"w": torch.ones(2)}}, "key s.w is a tensor inside a list, tuple or dict"),
    ({"w": torch.eye(2).to_sparse()}, "key w is a torch.sparse_coo tensor: key tensors are hashed by their"),
    ({"w": torch.ones(2, device="meta")}, "key w is a meta tensor"),
])
def test_bad_key_tensors_are_refused(tmp_path, key: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        FeatureCache(tmp_path).get_or_compute(key, lambda: {"x": torch.ones(1)})


def test_a_conjugate_view_key_hashes_as_its_values() -> None:
    c = torch.tensor([1 + 2j, 3 - 1j])
    assert key_hash({"c": c.conj()}) == key_hash({"c": c.conj().resolve_conj()}) != key_hash({"c": c})


def test_nan_and_inf_are_stored_as_computed(tmp_path) -> None:
    """The cache stores what compute() returned, bit for bit: NaN (with its payload), inf, -0.0.
    (Pins the documented choice; it held before issue 20 too.)"""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.0])
    x = torch.cat([x, torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)])  # a NaN payload
    first = FeatureCache(tmp_path).get_or_compute({"k": 1}, lambda: {"x": x})
    again = FeatureCache(tmp_path).get_or_compute({"k": 1}, lambda: {})
    for got in (first, again):
        assert torch.equal(got["x"].view(torch.int32), x.view(torch.int32))


def test_key_tensors_of_equal_bytes_and_another_dtype_differ() -> None:
    """Zeros are the same bytes in float32 and int32: the dtype is hashed, not only the bytes."""
    assert key_hash({"w": torch.zeros(3)}) != key_hash({"w": torch.zeros(3, dtype=torch.int32)})


def test_key_names_are_hashed() -> None:
    assert key_hash({"a": 1}) != key_hash({"b": 1})
    assert key_hash({"a": torch.ones(2)}) != key_hash({"b": torch.ones(2)})


def test_a_new_cache_format_misses(monkeypatch) -> None:
    before = key_hash({"k": 1})
    monkeypatch.setattr("kernels.feature_cache.FORMAT", "kernelgate-feature-cache-2")
    assert key_hash({"k": 1}) != before


def test_dict_order_does_not_change_the_hash() -> None:
    """The same key written in another insertion order (top level and nested) hits the same file."""
    assert key_hash({"a": 1, "b": {"x": 1, "y": 2}}) == key_hash({"b": {"y": 2, "x": 1}, "a": 1})


def test_a_negative_view_key_hashes_as_its_values() -> None:
    """A view with torch's negative bit (a conjugate's imaginary part; contiguous, as torch._neg_view
    gives it, nothing on the way copies it) is hashed by its values."""
    strided, flat = torch.tensor([1 + 2j, 3 - 1j]).conj().imag, torch._neg_view(torch.arange(3.0))
    assert strided.is_neg() and flat.is_neg() and flat.is_contiguous()
    for v in (strided, flat):
        assert key_hash({"v": v}) == key_hash({"v": v.clone()}) != key_hash({"v": -v.clone()})


def test_another_keys_file_in_this_keys_place_is_recomputed(tmp_path) -> None:
    """A valid file written for key A, copied to key B's path, is not B's features."""
    cache = FeatureCache(tmp_path)
    a, b = Counter(torch.ones(2)), Counter(torch.zeros(2))
    cache.get_or_compute({"k": "a"}, a)
    cache.path({"k": "b"}).write_bytes(cache.path({"k": "a"}).read_bytes())
    with pytest.warns(UserWarning, match="fails its key"):
        out = cache.get_or_compute({"k": "b"}, b)
    assert b.calls == 1 and torch.equal(out["features"], torch.zeros(2))


def test_a_renamed_tensor_fails_the_checksum(tmp_path) -> None:
    """The checksum covers each tensor's name: a file whose tensor was renamed is recomputed."""
    from safetensors.torch import save_file

    from kernels.feature_cache import read_safetensors

    cache, x = FeatureCache(tmp_path), torch.arange(4.0)
    cache.get_or_compute({"k": 1}, lambda: {"x": x})
    path = cache.path({"k": 1})
    _, meta = read_safetensors(path)
    save_file({"y": x}, path, metadata=meta)
    with pytest.warns(UserWarning, match="fails its checksum"):
        out = cache.get_or_compute({"k": 1}, lambda: {"x": x})
    assert list(out) == ["x"]
