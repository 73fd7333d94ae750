"""`make install`: this project, perfgate and the test tools into the running Python's venv.

uv installs them where it can (about 3x faster than pip with torch's 3 GB of CUDA wheels:
evidence/make-test-zen3.txt), from the sources pip is configured with (`pip config list`:
index-url, extra-index-url, find-links, no-index, constraint; its cert as SSL_CERT_FILE) and, as
pip does, the best version across all of them. Where uv cannot be installed or fails, pip
installs the same requirements.

    python scripts/install.py REQUIREMENT_ARGS...   (pip's own: -c FILE, -e PATH, ...)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pip's settings that say where packages come from, as uv's flags (a list setting repeats its flag)
SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
# pip reads environment variables over its config files' [install] over their [global]
PRECEDENCE = (":env:", "install", "global")


def pip_settings() -> dict[str, str]:
    """{key: value} of pip's configuration for ``pip install``: of each key, the value of the
    highest-precedence section that sets it (other commands' sections do not apply)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False).stdout
    found: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if sep and dot:
            found.setdefault(key, {})[section] = value.strip().strip("'\"")
    return {key: next(by[s] for s in PRECEDENCE if s in by) for key, by in found.items()
            if any(s in by for s in PRECEDENCE)}


def uv_sources(settings: dict[str, str]) -> list[str]:
    """uv flags for the package sources in pip's ``settings``."""
    flags = ["--index-strategy", "unsafe-best-match"]  # pip's choice: the best version on any index
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
    for key, flag in SOURCES.items():
        for value in settings.get(key, "").split():
            flags += [flag, value]
    return flags


def uv_environment(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment, with pip's ``cert`` (a CA bundle) as uv's SSL_CERT_FILE unless one is set."""
    env = dict(os.environ)
    if settings.get("cert") and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = settings["cert"]
    return env


def main(requirements: list[str]) -> int:
    pip = [sys.executable, "-m", "pip", "install", "--no-compile", *requirements]
    get_uv = [sys.executable, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), "uv"]
    installed_uv = subprocess.run(get_uv, check=False).returncode == 0
    if installed_uv:
        settings = pip_settings()
        uv = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable,
              *uv_sources(settings), *requirements]
        print("install:", shlex.join(uv), flush=True)
        if subprocess.run(uv, env=uv_environment(settings), check=False).returncode == 0:
            return 0
        print("install: uv failed (above); installing with pip", file=sys.stderr, flush=True)
    else:
        print("install: uv could not be installed; installing with pip", file=sys.stderr, flush=True)
    return subprocess.run(pip, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
