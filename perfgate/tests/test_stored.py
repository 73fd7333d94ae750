"""perfgate.stored: the one check of a stored run's shape, class by class of damage."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from perfgate.stored import BadRun, problem, read_run

WHOLE = {
    "benchmarks": [],
    "machine_info": {"perfgate": {"device_type": "cpu"}},
    "perfgate": {"fingerprint": {"device_type": "cpu"}, "slug": "cpu-x", "size": "smoke", "interrupted": False,
                 "speedups": [{"kernel": "k", "impl": "optimized", "size": "smoke", "speedup": 2.5}]},
}


def _damaged(path: str, value: object) -> dict:
    """WHOLE with the value at ``path`` (dotted; a digit indexes a list) replaced, or deleted for ...."""
    data = copy.deepcopy(WHOLE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    key = int(last) if last.isdigit() else last
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return data


DAMAGE = [
    ("benchmarks", ..., "no 'benchmarks' list"),
    ("perfgate", ..., "no 'perfgate' section"),
    ("perfgate.speedups", ..., "no valid 'speedups'"),
    ("perfgate.slug", 3, "no valid 'slug'"),
    ("perfgate.interrupted", True, "interrupted session"),
    ("machine_info.perfgate", ..., "machine_info has no 'perfgate' fingerprint"),
    ("perfgate.speedups.0", "2.5x", "speedup row 0 is not an object"),
    ("perfgate.speedups.0.kernel", ..., "speedup row 0 has no valid 'kernel'"),
    ("perfgate.speedups.0.speedup", "2.5", "speedup row 0 has no valid 'speedup'"),
    ("perfgate.speedups.0.speedup", True, "speedup row 0 has no valid 'speedup'"),
    ("perfgate.speedups.0.speedup", float("nan"), "has speedup nan"),
    ("perfgate.speedups.0.speedup", 0.0, "has speedup 0.0"),
]


def test_a_whole_run_has_no_problem() -> None:
    assert problem(WHOLE) is None and problem([WHOLE]) == "not a JSON object"


@pytest.mark.parametrize(("path", "value", "why"), DAMAGE, ids=[f"{p}={v!r}" for p, v, _ in DAMAGE])
def test_each_damage_is_named(path: str, value: object, why: str) -> None:
    found = problem(_damaged(path, value))
    assert found is not None and why in found, found


def test_read_run_names_the_file(tmp_path: Path) -> None:
    good, cut, nan = tmp_path / "good.json", tmp_path / "cut.json", tmp_path / "nan.json"
    good.write_text(json.dumps(WHOLE))
    cut.write_text(json.dumps(WHOLE)[:40])
    nan.write_text(json.dumps(_damaged("perfgate.speedups.0.speedup", float("nan"))))  # json writes NaN
    assert read_run(good)["_path"] == str(good)
    gone = tmp_path / "gone.json"
    for path, why in ((cut, "not readable as JSON"), (nan, "has speedup nan"), (gone, "No such")):
        with pytest.raises(BadRun, match=f"{path.name}.*{why}"):
            read_run(path)
