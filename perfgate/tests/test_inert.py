"""perfgate installed in an environment changes nothing of a pytest session that has no perf test:
what it imports, torch's threads, pytest-benchmark's save path and compare; and it works for a
project that is not the one it came from, without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# A conftest that records, at the session's end, what the process looks like.
RECORDER = """
import json, sys

def pytest_unconfigure(config):
    torch = sys.modules.get("torch")
    record = {
        "modules": sorted(m for m in sys.modules if not m.startswith("perfgate")),
        "threads": torch.get_num_threads() if torch is not None else None,
        "storage": config.getoption("benchmark_storage"),
    }
    with open("record.json", "w") as fh:
        json.dump(record, fh)
"""

TRIVIAL = """
def test_trivial():
    assert 1 + 1 == 2
"""

WITH_TORCH = """
import torch

def test_uses_torch():
    assert torch.ones(2).sum().item() == 2
"""

BENCHMARKED = """
def test_sum(benchmark):
    assert benchmark(sum, range(100)) == 4950
"""


def _session(pytester: pytest.Pytester, *args: str, plugin: bool) -> dict:
    """One subprocess session (a fresh interpreter: sys.modules is its own), with or without perfgate."""
    off = [] if plugin else ["-p", "no:perfgate"]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *off, *args)
    assert result.ret == 0, result.stdout.str()
    return json.loads((pytester.path / "record.json").read_text())


@pytest.mark.parametrize("suite", [TRIVIAL, WITH_TORCH], ids=["trivial", "imports-torch"])
def test_a_session_without_perf_tests_is_left_alone(pytester: pytest.Pytester, suite: str) -> None:
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(test_plain=suite)
    with_plugin, without = _session(pytester, plugin=True), _session(pytester, plugin=False)
    assert with_plugin["modules"] == without["modules"], (
        f"perfgate imported {sorted(set(with_plugin['modules']) - set(without['modules']))[:20]}")
    assert with_plugin["threads"] == without["threads"]
    assert with_plugin["storage"] == without["storage"]
    assert ("torch" in with_plugin["modules"]) == (suite == WITH_TORCH)


def test_the_plugin_is_active_when_loaded(pytester: pytest.Pytester) -> None:
    """The comparison above ran with perfgate loaded: its options exist, and a perf test starts it."""
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*--perf-device*"])
    flags = [ln.split()[0] for ln in result.stdout.lines if ln.strip().startswith("--perf")]
    assert flags and all(f.startswith("--perf-") for f in flags)
    assert "--device" not in {ln.split()[0].rstrip(",=") for ln in result.stdout.lines if ln.strip()}


@pytest.mark.paced  # a pytest-benchmark session: it times its benchmarks (a sum of 100 ints)
def test_pytest_benchmark_saves_and_compares_where_it_documents(pytester: pytest.Pytester) -> None:
    """--benchmark-save=foo writes .benchmarks/<machine id>/0001_foo.json (pytest-benchmark's
    layout), and --benchmark-compare compares against it, with no perfgate section."""
    from pytest_benchmark.utils import get_machine_id

    pytester.makepyfile(test_bench=BENCHMARKED)
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-save=foo").ret == 0
    saved = sorted((pytester.path / ".benchmarks").rglob("*.json"))
    assert saved == [pytester.path / ".benchmarks" / get_machine_id() / "0001_foo.json"]
    assert "perfgate" not in json.loads(saved[0].read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-compare",
                                           "--benchmark-compare-fail=mean:1000%")
    assert result.ret == 0
    result.stdout.fnmatch_lines_random(["*test_sum (0001_foo)*", "*test_sum (NOW)*"])


def test_importing_the_plugin_loads_nothing_heavy() -> None:
    """What every pytest session pays: the plugin module imports pytest and itself only."""
    code = ("import sys, perfgate.plugin; heavy = {'torch', 'numpy', 'scipy', 'matplotlib'} & set(sys.modules); "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# A project that is not kernelgate, and a process where torch cannot be imported.
NO_TORCH_CONFTEST = """
import sys

class NoTorch:  # `import torch` fails in this session, as where torch is not installed
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

assert "torch" not in sys.modules
sys.meta_path.insert(0, NoTorch)
"""

PLAIN_PAIR = """
import time
import pytest

@pytest.mark.speedup(cpu=2.0)
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_lookup(perf, impl):
    # a 6 ms reference against a 1 ms optimized side: a 6x pair by construction
    perf(lambda: time.sleep(0.006 if impl == "reference" else 0.001), label="sleep")
"""


@pytest.mark.paced
def test_a_project_without_torch_gets_a_working_gate(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(NO_TORCH_CONFTEST)
    pytester.makepyfile(test_plain_pair=PLAIN_PAIR)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.1",
                                           "--benchmark-json=out.json", "--perf-contended=inf")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*perfgate speedups*", "*lookup*optimized*ok*", "*gate passed*"])
    section = json.loads((pytester.path / "out.json").read_text())["perfgate"]
    assert section["fingerprint"]["torch"] is None and section["fingerprint"]["threads"] is None
    assert section["speedups"][0]["speedup"] > 2.0
    # and the gate still fails a pair under its floor there (judged however busy the host: a
    # contended reading would leave the failure unresolved, which test_contention.py tests)
    (pytester.path / "test_plain_pair.py").write_text(PLAIN_PAIR.replace("cpu=2.0", "cpu=20.0"))
    failed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.1",
                                           "--perf-contended=inf")
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
    failed.stdout.fnmatch_lines(["*GATE FAILED*lookup*"])


@pytest.mark.paced
def test_a_perf_session_moves_the_storage_to_its_fingerprint(pytester: pytest.Pytester) -> None:
    """The one change perfgate makes, and only in a session with a perf test: baselines are kept
    per fingerprint and size."""
    pytester.makeconftest(NO_TORCH_CONFTEST)
    pytester.makepyfile(test_plain_pair=PLAIN_PAIR)
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.1",
                                         "--benchmark-save=base").ret == 0
    saved = sorted((pytester.path / ".benchmarks").rglob("*.json"))
    assert len(saved) == 1 and saved[0].name == "0001_base.json"
    fingerprint_folder, size = saved[0].parents[2].name, saved[0].parents[1].name
    assert fingerprint_folder.startswith("cpu-") and size == "smoke"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.1",
                                           "--benchmark-compare")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"*compared against baseline in*{Path(fingerprint_folder) / size}*"])


# pytest-benchmark's own compare-warning cases (its tests/test_benchmark.py, 5.x: SIMPLE_TEST and
# the test_compare_* runs): a session without perf tests prints what pytest-benchmark alone does.
SIMPLE_TEST = '''
"""
    >>> print('Yay, doctests!')
    Yay, doctests!
"""
import time

def test_fast(benchmark):
    benchmark(time.sleep, 0.000001)
'''
COMPARE_CASES = {
    "no files": ["--benchmark-compare", "-rw"],
    "no files, verbose": ["--benchmark-compare", "--benchmark-verbose"],
    "no files match": ["--benchmark-compare=1", "-rw"],
    "non-existing": ["--benchmark-compare=0002", "-rw"],
    "existing": ["--benchmark-compare=0001", "--benchmark-compare-fail=min:1000%"],
    "last": ["--benchmark-compare", "--benchmark-compare-fail=min:1000%"],
}


def _printed(pytester: pytest.Pytester, args: list[str], perfgate: bool) -> tuple[list[str], list[str]]:
    """The lines about the compare or a warning, in order, on stderr and on stdout (the warnings
    summary), of one run (--benchmark-verbose's calibration lines vary run to run)."""
    plugins = [] if perfgate else ["-p", "no:perfgate"]
    result = pytester.runpytest_subprocess(*plugins, "-p", "no:cacheprovider", "--benchmark-max-time=0.0000001",
                                           "--doctest-modules", *args, "test_simple.py")
    assert result.ret == 0, result.outlines + result.errlines
    def about_compare(lines: list[str]) -> list[str]:
        return [line for line in lines if re.search(r"compar|warn", line, re.IGNORECASE)]

    return about_compare(result.errlines), about_compare(result.outlines)


# Not marked timed: what these sessions time (a sleep, for a tenth of a microsecond) is not read.
@pytest.mark.parametrize("case", COMPARE_CASES)
def test_compare_prints_as_pytest_benchmark_alone(pytester: pytest.Pytester, case: str) -> None:
    """Where and what pytest-benchmark prints about --benchmark-compare (its "Can't compare" warning
    and "Comparing against" line on stderr, nothing in the warnings summary) is the same with
    perfgate installed as with it disabled, in a session without perf tests."""
    pytester.makepyfile(test_simple=SIMPLE_TEST)
    if case in ("non-existing", "existing", "last"):
        pytester.runpytest_subprocess("-p", "no:perfgate", "-p", "no:cacheprovider", "--benchmark-autosave",
                                      "--benchmark-max-time=0.0000001", "test_simple.py")
    alone = _printed(pytester, COMPARE_CASES[case], perfgate=False)
    with_perfgate = _printed(pytester, COMPARE_CASES[case], perfgate=True)
    assert with_perfgate == alone
    assert any("Can't compare" in line or "Comparing against" in line for line in alone[0])  # the case prints
