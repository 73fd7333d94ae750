"""REV's copy of the project for ``--perf-against REV``: a git revision exported into a scratch
folder (``git archive``, so the repository itself gains nothing: no worktree entry, no ref), or a
folder the user names, used as it is. The scratch folder is removed when the comparison ends, on
success, failure or Ctrl-C; one that a killed process left behind is swept by the next session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "perfgate-against-"  # scratch folders are named PREFIX<pid>-<random>, with an owner.json


class CheckoutError(ValueError):
    """REV cannot be resolved or exported; the message names REV and what would work."""


@dataclass(frozen=True)
class Revision:
    """REV resolved: a commit ``sha`` of the repository at ``repo`` (the project root is ``prefix``
    inside it), or a ``folder`` holding another copy of the project."""

    rev: str
    repo: Path | None = None
    sha: str | None = None
    prefix: str = ""
    folder: Path | None = None

    @property
    def label(self) -> str:
        """How reports name REV: the revision as given, and its commit."""
        return f"{self.rev} ({self.sha[:12]})" if self.sha else str(self.folder)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise CheckoutError("--perf-against needs git on PATH (or a folder holding the other copy)") from exc


def resolve(rev: str, rootdir: Path) -> Revision:
    """Resolve ``rev`` (a git revision of the repository holding ``rootdir``, or a folder) before
    anything is timed: a revision that does not name a commit is refused here."""
    if not rev.strip():
        raise CheckoutError("--perf-against needs a git revision (HEAD, HEAD~1, main, a SHA) or a folder")
    folder = Path(rev).expanduser()
    top = _git(rootdir, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        if folder.is_dir():
            return Revision(rev, folder=folder.resolve())
        raise CheckoutError(f"--perf-against {rev}: {rootdir} is not in a git repository, and {rev} is not a "
                            "folder; give a folder holding the other copy of the project")
    repo = Path(top.stdout.strip())
    commit = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if commit.returncode == 0 and folder.is_dir():
        raise CheckoutError(f"--perf-against {rev}: both a git revision and a folder; write ./{rev} for the "
                            f"folder or refs/heads/{rev} for the branch")
    if commit.returncode != 0:
        if folder.is_dir():
            return Revision(rev, folder=folder.resolve())
        shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        hint = (" This clone is shallow: fetch the history (actions/checkout: fetch-depth: 0, or git fetch "
                "--unshallow)." if shallow else "")
        raise CheckoutError(f"--perf-against {rev}: not a commit of {repo} (try HEAD, HEAD~1, a branch or a "
                            f"SHA; git log --oneline lists them), nor a folder.{hint}")
    prefix = Path(rootdir).resolve().relative_to(repo.resolve()).as_posix()
    return Revision(rev, repo=repo, sha=commit.stdout.strip(), prefix="" if prefix == "." else prefix)


def export(revision: Revision, scratch: Path) -> Path:
    """Write REV's tree under ``scratch``/tree and return its copy of the project root."""
    tree = scratch / "tree"
    tree.mkdir()
    archive = scratch / "tree.tar"
    with archive.open("wb") as out:
        done = subprocess.run(["git", "-C", str(revision.repo), "archive", "--format=tar", str(revision.sha)],
                              stdout=out, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise CheckoutError(f"--perf-against {revision.rev}: git archive failed: {done.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")  # "data": no absolute paths, links out of the tree or devices
    archive.unlink()
    return tree / revision.prefix


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(tmp: Path | None = None) -> list[Path]:
    """Remove the scratch folders of sessions that no longer run (a SIGKILL skips every cleanup);
    return what was removed. A folder without a readable owner.json is left alone."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = json.loads((folder / "owner.json").read_text(encoding="utf8"))
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def scratch_folder(rev: str, tmp: Path | None = None) -> Iterator[Path]:
    """A folder this session owns (its owner.json names the pid) for the duration of the block:
    removed however the block ends, or by a later session's ``sweep`` after a SIGKILL."""
    sweep(tmp)
    scratch = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp))
    try:
        (scratch / "owner.json").write_text(json.dumps({"pid": os.getpid(), "rev": rev}), encoding="utf8")
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def checked_out(revision: Revision, tmp: Path | None = None) -> Iterator[Path]:
    """REV's copy of the project root for the duration of the block: the user's folder, or an
    export in a scratch folder that is removed however the block ends."""
    if revision.folder is not None:
        yield revision.folder
        return
    with scratch_folder(revision.rev, tmp) as scratch:
        yield export(revision, scratch)
