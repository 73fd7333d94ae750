"""REV's copy for --perf-against: which revisions resolve and how a bad one is named, the export's
contents, and that nothing is left behind however the comparison ends."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from perfgate.checkout import PREFIX, CheckoutError, Revision, checked_out, resolve, sweep


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with two commits of lib/work.py (v1, then v2) and a branch at the first."""
    root = tmp_path / "repo"
    (root / "lib").mkdir(parents=True)
    _git(root, "init", "-q", "-b", "main")
    for version in ("v1", "v2"):
        (root / "lib" / "work.py").write_text(f"VERSION = {version!r}\n")
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "-m", version)
        if version == "v1":
            _git(root, "branch", "first")
    return root


def _version(root: Path) -> str:
    return (root / "lib" / "work.py").read_text().split("'")[1]


@pytest.mark.parametrize(("rev", "version"), [("HEAD", "v2"), ("HEAD~1", "v1"), ("first", "v1"), ("main", "v2")])
def test_a_revision_exports_its_tree(repo: Path, tmp_path: Path, rev: str, version: str) -> None:
    revision = resolve(rev, repo)
    assert revision.sha == _git(repo, "rev-parse", rev) and revision.label.startswith(f"{rev} (")
    with checked_out(revision, tmp_path) as root:
        assert _version(root) == version
        assert not (root / ".git").exists()
        scratch = root.parent  # the export's tree beside the session's owner.json, the archive removed
        assert sorted(p.name for p in scratch.iterdir()) == ["owner.json", "tree"]
        assert json.loads((scratch / "owner.json").read_text()) == {"pid": os.getpid(), "rev": rev}
    assert _version(repo) == "v2"


def test_a_sha_and_a_folder_resolve(repo: Path, tmp_path: Path) -> None:
    sha = _git(repo, "rev-parse", "HEAD~1")
    assert resolve(sha[:10], repo).sha == sha
    other = tmp_path / "other"
    other.mkdir()
    folder = resolve(str(other), repo)
    assert folder.folder == other and folder.sha is None
    with checked_out(folder, tmp_path) as root:
        assert root == other
    assert other.is_dir()  # the user's folder is theirs: never removed


def test_a_project_in_a_subfolder_gets_its_subfolder(repo: Path, tmp_path: Path) -> None:
    revision = resolve("HEAD~1", repo / "lib")
    assert revision.prefix == "lib"
    with checked_out(revision, tmp_path) as root:
        assert (root / "work.py").read_text() == "VERSION = 'v1'\n"


@pytest.mark.parametrize("rev", ["HEAD~5", "no-such-branch", "deadbeef", " "])
def test_a_revision_that_names_no_commit_is_refused_by_name(repo: Path, rev: str) -> None:
    with pytest.raises(CheckoutError, match="--perf-against") as error:
        resolve(rev, repo)
    if rev.strip():
        assert f"--perf-against {rev}: not a commit of" in str(error.value) and "HEAD~1" in str(error.value)
    else:
        assert "needs a git revision" in str(error.value)


def test_a_shallow_clone_is_told_to_fetch_the_history(repo: Path, tmp_path: Path) -> None:
    clone = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True)
    with pytest.raises(CheckoutError, match="shallow.*fetch-depth: 0"):
        resolve("HEAD~1", clone)


def test_outside_git_only_a_folder_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(CheckoutError, match="not in a git repository"):
        resolve("HEAD", plain)
    assert resolve(str(tmp_path), plain).folder == tmp_path
    monkeypatch.chdir(tmp_path)
    assert resolve("plain", plain).folder == plain  # a relative folder, made absolute


def test_a_commit_git_cannot_export_is_named_and_leaves_nothing(repo: Path, tmp_path: Path) -> None:
    gone = Revision("gone", repo=repo, sha="0" * 40)  # resolved, then lost (a gc, a force-push)
    with pytest.raises(CheckoutError, match="--perf-against gone: git archive failed"):
        with checked_out(gone, tmp_path):
            pass
    assert list(tmp_path.glob(f"{PREFIX}*")) == []


def test_a_name_that_is_both_a_branch_and_a_folder_is_refused(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (repo / "first").mkdir()
    monkeypatch.chdir(repo)
    with pytest.raises(CheckoutError, match=r"write ./first for the folder or refs/heads/first"):
        resolve("first", repo)


def test_nothing_is_left_behind_after_an_interrupt(repo: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(KeyboardInterrupt), checked_out(resolve("HEAD~1", repo), scratch) as root:
        assert root.is_relative_to(scratch)
        raise KeyboardInterrupt
    assert list(scratch.iterdir()) == []
    assert _git(repo, "status", "--porcelain", "--ignored") == ""
    assert len(_git(repo, "worktree", "list").splitlines()) == 1


def test_a_killed_sessions_folder_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])  # its pid, once it has exited, is a killed session's
    child.wait()
    folders = {}
    for name, pid in (("dead", child.pid), ("live", os.getpid())):
        folders[name] = tmp_path / f"{PREFIX}{name}"
        folders[name].mkdir()
        (folders[name] / "owner.json").write_text(json.dumps({"pid": pid}))
    unknown = tmp_path / f"{PREFIX}unknown"
    unknown.mkdir()
    kept = [unknown]
    for name, owner in (("torn", '{"pid": 1'), ("pidless", '{"rev": "HEAD"}'), ("list", "[1]")):
        kept.append(tmp_path / f"{PREFIX}{name}")  # an owner.json this sweep cannot read: not known to be dead
        kept[-1].mkdir()
        (kept[-1] / "owner.json").write_text(owner)
    assert sweep(tmp_path) == [folders["dead"]]
    assert folders["live"].is_dir() and all(k.is_dir() for k in kept) and not folders["dead"].exists()


def test_another_users_session_is_alive_and_a_new_scratch_folder_sweeps_first(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    dead = tmp_path / f"{PREFIX}dead"
    dead.mkdir()
    (dead / "owner.json").write_text(json.dumps({"pid": child.pid}))
    with checked_out(resolve("HEAD", repo), tmp_path):
        assert not dead.exists()  # swept before this session's folder was made
    dead.mkdir()
    (dead / "owner.json").write_text(json.dumps({"pid": child.pid}))

    def not_permitted(pid: int, signal: int) -> None:  # a live process of another user
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_permitted)
    assert sweep(tmp_path) == [] and dead.is_dir()

