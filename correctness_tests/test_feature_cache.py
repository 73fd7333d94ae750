"""kernels.FeatureCache: hits by content, misses on any change, atomic writes, and corrupted or
tampered files detected and recomputed with a warning; never pickle."""

from __future__ import annotations

import pickle

import pytest
import torch

from kernels.feature_cache import FeatureCache, key_hash


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
    with pytest.raises(TypeError, match=r"dict\[str, Tensor\]"):
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
