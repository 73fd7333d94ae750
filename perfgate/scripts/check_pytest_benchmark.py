"""pytest-benchmark's own test suite, run without perfgate and with it: the same tests must fail.

perfgate promises to leave a session without perf tests to pytest-benchmark alone; a suite
nobody here wrote is the strongest check of that. Usage (``make check-pytest-benchmark``):

    python perfgate/scripts/check_pytest_benchmark.py [--source DIR_OR_SDIST] [--venv DIR]

``--source``: a pytest-benchmark checkout or sdist (.tar.gz); by default the sdist of the
pytest-benchmark version installed beside this script's Python, fetched by pip from its index
(the only download, before any test runs). The suite runs in its own venv (``--venv``, made when
missing) with pytest-benchmark's test extras and this perfgate installed; each run is
``python -m pytest tests`` in the source folder, once with ``-p no:perfgate``. Exit 0 when the
failing tests are the same, 1 when they differ (both lists printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

PERFGATE = Path(__file__).resolve().parents[1]
# pytest-benchmark's tox environment: its extras and dev group (pyproject.toml, tox.ini)
TEST_EXTRAS = "aspect,elasticsearch,histogram"
# pytest-xdist besides: its xdist cases skip without it, and perfgate refuses perf tests under xdist
TEST_DEPS = ["freezegun>=1.5.5", "nbmake>=1.5.5", "pygal==3.1.3", "pygaljs==1.0.2", "hunter", "pytest-xdist"]


def _source(given: str | None, work: Path) -> Path:
    """The pytest-benchmark source folder: ``given`` (a folder, or an sdist unpacked into
    ``work``), else the installed version's sdist from pip's index."""
    if given is not None and Path(given).is_dir():
        return Path(given).resolve()
    if given is None:
        version = importlib.metadata.version("pytest-benchmark")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(work), f"pytest-benchmark=={version}"], check=True)
        given = str(next(work.glob("pytest_benchmark-*.tar.gz")))
    if not Path(given).is_file() or not given.endswith(".tar.gz"):
        raise SystemExit(f"--source must be a pytest-benchmark checkout or its sdist (.tar.gz), got {given!r}")
    with tarfile.open(given) as tar:
        tar.extractall(work, filter="data")
    (folder,) = [p for p in work.iterdir() if p.is_dir() and (p / "tests").is_dir()]
    return folder


def _venv(path: Path, source: Path) -> Path:
    """A venv with the source's pytest-benchmark (editable, its test extras) and this perfgate."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{source}[{TEST_EXTRAS}]", *TEST_DEPS,
                    "-e", str(PERFGATE)], check=True)
    return python


def _failures(python: Path, source: Path, *extra: str) -> dict[str, str]:
    """The node ids that failed or errored in one run of the suite, each with the first line of
    its message (from the run's junit XML)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        run = subprocess.run([str(python), "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
                              f"--junitxml={report}", *extra], cwd=source,
                             # as its tox env: the venv's console scripts first (its CLI tests run
                             # py.test-benchmark), its tests folder importable, 80 columns
                             env={**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                                  "PYTHONPATH": str(source / "tests"), "COLUMNS": "80"})
        print(f"pytest {' '.join(extra) or '(perfgate installed)'}: exit {run.returncode}")
        if not report.exists():
            raise SystemExit(f"pytest-benchmark's suite wrote no report (exit {run.returncode})")
        failed = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if problem is not None:
                message = (problem.get("message") or "").strip().splitlines()
                failed[f"{case.get('classname')}::{case.get('name')}"] = message[0][:160] if message else ""
        return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", help="a pytest-benchmark checkout or sdist (.tar.gz)")
    parser.add_argument("--venv", default=".venv-pytest-benchmark", help="the venv to run the suite in")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        source = _source(args.source, Path(work))
        python = _venv(Path(args.venv).resolve(), source)
        alone = _failures(python, source, "-p", "no:perfgate")
        with_perfgate = _failures(python, source)
    def listed(title: str, failed: dict[str, str], names: set[str]) -> None:
        print(f"{title} ({len(names)}):", *(f"{n}: {failed[n]}" for n in sorted(names)), sep="\n  ")

    listed("failing without perfgate", alone, set(alone))
    if set(with_perfgate) == set(alone):
        print("the same tests fail with perfgate installed")
        return 0
    listed("failing only with perfgate", with_perfgate, set(with_perfgate) - set(alone))
    listed("failing only without perfgate", alone, set(alone) - set(with_perfgate))
    return 1


if __name__ == "__main__":
    sys.exit(main())
