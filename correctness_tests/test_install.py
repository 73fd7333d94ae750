"""`make install` (scripts/install.py): uv gets the package sources pip is configured with, and pip
installs the same requirements where uv cannot."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install.py"
spec = importlib.util.spec_from_file_location("install", SCRIPT)
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)

PIP_CONFIG_LIST = """\
:env:.find-links='/opt/env-wheels'
global.find-links='/opt/wheels'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
global.constraint='/etc/xdg/pip/constraints.txt'
download.no-index='true'
global.cert='/etc/ssl/certs/ca-certificates.crt'
"""


def _fake_run(results: dict[str, int], calls: list[list[str]]):
    """subprocess.run recording each command: `pip config list` prints PIP_CONFIG_LIST; a command
    containing a key of ``results`` returns that code."""
    def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if cmd[1:] == ["-m", "pip", "config", "list"]:
            return subprocess.CompletedProcess(cmd, 0, stdout=PIP_CONFIG_LIST, stderr="")
        code = next((c for key, c in results.items() if key in " ".join(cmd)), 0)
        return subprocess.CompletedProcess(cmd, code, stdout="", stderr="")
    return run


def test_uv_reads_the_sources_pip_install_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_run({}, []))
    flags = install.uv_sources(install.pip_settings())
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    assert ("--index-strategy", "unsafe-best-match") in pairs  # pip's best version across indexes
    assert ("--index-url", "https://install.example/simple") in pairs  # [install] over [global]
    assert ("--find-links", "/opt/env-wheels") in pairs and ("--find-links", "/opt/wheels") not in pairs
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert "--no-index" not in flags  # set for `pip download` only


def test_pips_ca_bundle_is_uvs_unless_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_run({}, []))
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert install.uv_environment(install.pip_settings())["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
    monkeypatch.setenv("SSL_CERT_FILE", "/mine.pem")
    assert install.uv_environment(install.pip_settings())["SSL_CERT_FILE"] == "/mine.pem"


GET_UV, UV, PIP = "install -q -c", "-m uv pip install", "-m pip install --no-compile"


@pytest.mark.parametrize(("failing", "ran"), [(None, [GET_UV, UV]), (UV, [GET_UV, UV, PIP]),
                                              (GET_UV, [GET_UV, PIP])])
def test_pip_installs_what_uv_cannot(monkeypatch: pytest.MonkeyPatch, failing: str | None, ran: list[str]) -> None:
    """uv installs; where uv fails, or cannot itself be installed, pip installs the same arguments."""
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _fake_run({} if failing is None else {failing: 1}, calls))
    requirements = ["-c", "constraints.txt", "-e", "./perfgate", "-e", ".[test]"]
    assert install.main(requirements) == 0
    installs = [c for c in calls if c[1:] != ["-m", "pip", "config", "list"]]
    assert [next(k for k in (GET_UV, UV, PIP) if k in " ".join(c)) for c in installs] == ran
    assert installs[-1][-len(requirements):] == requirements


def test_a_failure_of_both_is_the_exit_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_run({UV: 1, PIP: 2}, []))
    assert install.main(["-e", "."]) == 2
