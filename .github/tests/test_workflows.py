"""The workflows cannot hand a fork's code to a self-hosted runner: each self-hosted job's `if:` is
evaluated against simulated events (a fork's PR runs only when a maintainer applies the approval
label, for that event's commit), triggers that run fork code with secrets are refused, no secrets
reach those jobs, and every action is pinned to a commit (docs/baselines-and-ci.md). A job counts
as self-hosted unless all its runs-on labels are GitHub-hosted images; reusable workflows, which
this checker does not follow, are refused."""

from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path

import pytest
import yaml
from github_expressions import ExpressionError, condition, evaluate, interpolate, parse, truthy

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
APPROVAL_LABEL = "gpu-perf-approved"
REPO, FORK = "kernelgate/kernelgate", "someone/kernelgate"
# Triggers that run with secrets or a write token while the code may come from a fork.
FORBIDDEN_TRIGGERS = {"pull_request_target", "workflow_run", "issue_comment", "pull_request_review",
                      "pull_request_review_comment"}
PR_DEFAULT_TYPES = {"opened", "synchronize", "reopened"}


# -- simulated events ---------------------------------------------------------------------------

def _github(event_name: str, event: dict, ref: str, run_id: int) -> dict:
    return {"github": {"event_name": event_name, "event": event, "repository": REPO, "ref": ref,
                       "run_id": str(run_id)}, "inputs": {}, "vars": {}, "env": {}}


def pull_request(action: str, *, fork: bool, labels: tuple[str, ...] = (), label: str | None = None,
                 run_id: int = 1) -> dict:
    event = {"action": action, "number": 7,
             "pull_request": {"head": {"repo": {"full_name": FORK if fork else REPO}},
                              "labels": [{"name": n} for n in labels]}}
    if label is not None:
        event["label"] = {"name": label}
    return _github("pull_request", event, "refs/pull/7/merge", run_id)


def dispatch() -> dict:
    ctx = _github("workflow_dispatch", {"inputs": {"gpu": "h100", "save_baseline": False}}, "refs/heads/main", 1)
    ctx["inputs"] = {"gpu": "h100", "save_baseline": False}
    return ctx


PUSH = _github("push", {"ref": "refs/heads/main"}, "refs/heads/main", 1)
APPROVED = "fork PR labeled with the approval label"
# name -> (context, may a self-hosted job run?): events of this repository's own code.
OWN_SCENARIOS: dict[str, tuple[dict, bool]] = {
    "same-repo PR synchronize": (pull_request("synchronize", fork=False), True),
    "push to main": (PUSH, True),
    "workflow_dispatch": (dispatch(), True),
}


def pr_types(wf: dict) -> list[str]:
    """The actions the workflow's pull_request trigger declares (GitHub's defaults where none)."""
    types = (triggers(wf).get("pull_request") or {}).get("types", sorted(PR_DEFAULT_TYPES))
    return [types] if isinstance(types, str) else list(types)


def scenarios(wf: dict) -> dict[str, tuple[dict, bool]]:
    """Name -> (context, may a self-hosted job run?): a fork's PR for every action the trigger
    declares, with and without the approval label on it, and labeled with the approval label or
    another; of the fork's events only the approval label's `labeled` may run."""
    fork: dict[str, tuple[dict, bool]] = {}
    for action in dict.fromkeys([*pr_types(wf), "labeled"]):
        if action == "labeled":
            fork[APPROVED] = (
                pull_request(action, fork=True, labels=(APPROVAL_LABEL,), label=APPROVAL_LABEL), True)
            fork["fork PR labeled with another label, approval label on it"] = (
                pull_request(action, fork=True, labels=(APPROVAL_LABEL, "docs"), label="docs"), False)
        elif action == "unlabeled":
            fork["fork PR unlabeled, the approval label removed"] = (
                pull_request(action, fork=True, label=APPROVAL_LABEL), False)
            fork["fork PR unlabeled another label, approval label on it"] = (
                pull_request(action, fork=True, labels=(APPROVAL_LABEL,), label="docs"), False)
        else:
            fork[f"fork PR {action}, approval label on it"] = (
                pull_request(action, fork=True, labels=(APPROVAL_LABEL,)), False)
            fork[f"fork PR {action}, no label"] = (pull_request(action, fork=True), False)
    return fork | OWN_SCENARIOS


# -- the checks ---------------------------------------------------------------------------------

def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf8"))


def triggers(wf: dict) -> dict:
    """`on:` as {event: config}; YAML reads the key `on` as True."""
    on = wf.get("on", wf.get(True))
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return dict(on or {})


def triggered(wf: dict, ctx: dict) -> bool:
    """Whether the event starts the workflow (branch and path filters ignored: assumed to match)."""
    event, config = ctx["github"]["event_name"], triggers(wf)
    if event not in config:
        return False
    if event != "pull_request":
        return True
    types = (config[event] or {}).get("types", PR_DEFAULT_TYPES)
    return ctx["github"]["event"]["action"] in ([types] if isinstance(types, str) else types)


# GitHub's image labels (ubuntu-24.04-arm, windows-2025, macos-14-xlarge): a custom label such as
# ubuntu-gpu is a self-hosted runner's.
HOSTED_LABEL = re.compile(r"(ubuntu|windows|macos)-(latest|[\d.]+)(-(arm|intel|large|xlarge))?", re.I)


def self_hosted(job: dict) -> bool:
    """Unless every runs-on label is a GitHub-hosted image (ubuntu-*, windows-*, macos-*), the job
    may reach a self-hosted runner: other labels, a runner group, a computed label, no runs-on."""
    runs_on = job.get("runs-on")
    if isinstance(runs_on, dict):
        if "group" in runs_on:
            return True
        runs_on = runs_on.get("labels")
    labels = [runs_on] if isinstance(runs_on, str) else runs_on
    return not (isinstance(labels, list) and labels
                and all(isinstance(x, str) and HOSTED_LABEL.fullmatch(x.strip()) for x in labels))


def can_run(wf: dict, name: str, ctx: dict) -> bool:
    """Whether the job runs in this event for some outcome of the jobs it needs (each needed job
    that runs may succeed or fail; one that cannot run is skipped)."""
    job = wf["jobs"][name]
    needs = job.get("needs") or []
    needs = [needs] if isinstance(needs, str) else needs
    outcomes = [("success", "failure") if can_run(wf, n, ctx) else ("skipped",) for n in needs]
    tree = condition(job.get("if"))
    for combo in itertools.product(*outcomes):
        status = {"always": True, "cancelled": False, "success": all(o == "success" for o in combo),
                  "failure": any(o == "failure" for o in combo)}
        if truthy(evaluate(tree, ctx, status)):
            return True
    return False


def fork_problems(wf: dict) -> list[str]:
    """What lets a fork run code on a self-hosted runner: a reusable workflow (not followed), a
    refused trigger, or a job that runs in a simulated event where it must not."""
    problems = [f"job {n!r} calls the reusable workflow {j['uses']}: the checker does not follow "
                "reusable workflows" for n, j in wf.get("jobs", {}).items() if "uses" in j]
    jobs = [n for n, j in wf.get("jobs", {}).items() if self_hosted(j)]
    if not jobs:
        return problems
    problems += [f"trigger {t} runs fork code with secrets or a write token" for t in triggers(wf)
                 if t in FORBIDDEN_TRIGGERS]
    if "workflow_call" in triggers(wf):
        problems.append("trigger workflow_call: the checker does not follow reusable workflows")
    for scenario, (ctx, allowed) in scenarios(wf).items():
        if not allowed and triggered(wf, ctx):
            problems += [f"self-hosted job {n!r} runs on: {scenario}" for n in jobs if can_run(wf, n, ctx)]
    return problems


def _strings(node: object):
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif node is not None:
        yield str(node)


def secret_problems(wf: dict) -> list[str]:
    """Secrets reaching a self-hosted job (its own text, or the workflow's env), and checkouts that
    leave the token in .git/config."""
    problems = []
    for name, job in wf.get("jobs", {}).items():
        if not self_hosted(job):
            continue
        text = [*_strings(job), *_strings(wf.get("env"))]
        if any(re.search(r"\bsecrets\b\s*(\.|\[|:)", s) or s == "secrets" for s in text):
            problems.append(f"self-hosted job {name!r} can read secrets")
        for step in job.get("steps", []):
            if str(step.get("uses", "")).startswith("actions/checkout@") and \
                    (step.get("with") or {}).get("persist-credentials") is not False:
                problems.append(f"self-hosted job {name!r}: checkout without persist-credentials: false")
    return problems


USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<ref>[^\s#]+)\s*(?:#\s*(?P<comment>.*))?$")
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
VERSION = re.compile(r"^v\d+(\.\d+)*\b")


def pin_problems(text: str) -> list[str]:
    """Every non-local `uses:` pinned to a 40-hex commit with a `# vX.Y.Z` comment."""
    wf = yaml.safe_load(text)
    parsed = [j.get("uses") for j in wf.get("jobs", {}).values() if "uses" in j] + [
        s["uses"] for j in wf.get("jobs", {}).values() for s in j.get("steps", []) if "uses" in s]
    lines = [m for m in map(USES_LINE.match, text.splitlines()) if m]
    if sorted(m["ref"].strip("'\"") for m in lines) != sorted(parsed):
        return [f"`uses:` not one to a line, so its comment cannot be read: {parsed}"]
    return [f"not pinned to a commit with a version comment: {m.group(0).strip()}" for m in lines
            if not m["ref"].startswith("./") and not (PINNED.match(m["ref"].strip("'\""))
                                                     and VERSION.match(m["comment"] or ""))]


# -- the workflows as they are -------------------------------------------------------------------

ALL = sorted(p.name for p in WORKFLOWS.glob("*.y*ml"))


def test_workflows_are_found() -> None:
    assert {"ci.yml", "gpu-perf.yml"} <= set(ALL)
    assert any(self_hosted(j) for j in load("gpu-perf.yml")["jobs"].values())


@pytest.mark.parametrize("name", ALL)
def test_no_fork_runs_on_a_self_hosted_runner(name: str) -> None:
    assert fork_problems(load(name)) == []


@pytest.mark.parametrize("name", ALL)
def test_no_secrets_in_self_hosted_jobs(name: str) -> None:
    assert secret_problems(load(name)) == []


@pytest.mark.parametrize("name", ALL)
def test_actions_are_pinned(name: str) -> None:
    assert pin_problems((WORKFLOWS / name).read_text(encoding="utf8")) == []


def guard_problems(wf: dict) -> list[str]:
    """No gpu-perf job, the hosted merge included, runs where a self-hosted job may not; where one
    may, perf (the suite against the stored baseline) and its merge run on pushes and dispatch, and
    against on pull requests, each on all of its events and nothing else."""
    problems = []
    for scenario, (ctx, allowed) in scenarios(wf).items():
        pr = ctx["github"]["event_name"] == "pull_request"
        for n in wf["jobs"]:
            ran = triggered(wf, ctx) and can_run(wf, n, ctx)
            if ran != (allowed and pr == (n == "against")):
                problems.append(f"job {n!r} {'runs' if ran else 'does not run'} on: {scenario}")
    return problems


def test_gpu_perf_guard_on_every_job() -> None:
    assert guard_problems(load("gpu-perf.yml")) == []


def test_against_runs_on_every_allowed_pull_request_and_nothing_else() -> None:
    """The PR-against-base job: each pull request a self-hosted job may run, no push or dispatch;
    the whole history checked out (the base commit is exported from it)."""
    wf = load("gpu-perf.yml")
    for scenario, (ctx, allowed) in scenarios(wf).items():
        pr = ctx["github"]["event_name"] == "pull_request"
        assert (triggered(wf, ctx) and can_run(wf, "against", ctx)) == (allowed and pr), scenario
    checkout = wf["jobs"]["against"]["steps"][0]
    assert checkout["uses"].startswith("actions/checkout@") and checkout["with"]["fetch-depth"] == 0


def concurrency_problems(wf: dict) -> list[str]:
    """The scenarios where the concurrency group's copy of the guard disagrees with the jobs': a run
    in which no job runs must get `-skipped-<run_id>`, and only such a run."""
    problems = []
    for scenario, (ctx, _) in scenarios(wf).items():
        github = ctx["github"]
        skipped = "" if any(can_run(wf, n, ctx) for n in wf["jobs"]) else f"-skipped-{github['run_id']}"
        if interpolate(wf["concurrency"]["group"], ctx) != f"gpu-perf-{github['ref']}{skipped}":
            problems.append(scenario)
    return problems


def test_gpu_perf_skipped_runs_queue_apart() -> None:
    """A run the guard skips gets its own concurrency group, so it cannot replace a waiting run."""
    wf = load("gpu-perf.yml")
    assert concurrency_problems(wf) == []
    group = wf["concurrency"]["group"]
    skipped = pull_request("synchronize", fork=True, labels=(APPROVAL_LABEL,), run_id=99)
    assert interpolate(group, scenarios(wf)[APPROVED][0]) == "gpu-perf-refs/pull/7/merge"
    assert interpolate(group, skipped) == "gpu-perf-refs/pull/7/merge-skipped-99"


# -- the checks fail where they should -----------------------------------------------------------

def _doctored(**jobs_if: str | None) -> dict:
    wf = copy.deepcopy(load("gpu-perf.yml"))
    for job, cond in jobs_if.items():
        if cond is None:
            del wf["jobs"][job]["if"]
        else:
            wf["jobs"][job]["if"] = cond
    return wf


def test_guard_removed_is_reported() -> None:
    problems = fork_problems(_doctored(against=None))
    assert "self-hosted job 'against' runs on: fork PR synchronize, approval label on it" in problems
    assert len(problems) == 7  # opened, synchronize, reopened (label on it or not), another label


def test_guard_on_the_label_present_is_reported() -> None:
    """A label left on the PR would approve every later push: the check refuses it (contains() is
    outside the evaluated subset, so it raises), and the evaluable variant fails the check."""
    with pytest.raises(ExpressionError, match="contains"):
        fork_problems(_doctored(against="github.event_name == 'pull_request' && "
                                        f"contains(github.event.pull_request.labels.*.name, '{APPROVAL_LABEL}')"))
    any_label = _doctored(against="github.event_name == 'pull_request' && github.event.action == 'labeled'")
    assert fork_problems(any_label) == [
        "self-hosted job 'against' runs on: fork PR labeled with another label, approval label on it"]


def test_merge_without_the_guard_is_reported() -> None:
    """!cancelled() alone runs the merge when perf was skipped: on every pull request."""
    assert guard_problems(_doctored(merge="${{ !cancelled() }}")) == [
        f"job 'merge' runs on: {s}" for s, (ctx, _) in scenarios(load("gpu-perf.yml")).items()
        if ctx["github"]["event_name"] == "pull_request"]


@pytest.mark.parametrize(("runs_on", "hosted"), [
    ("ubuntu-latest", True), (["ubuntu-24.04"], True), ({"labels": ["windows-latest"]}, True),
    ("macos-14", True), ("ubuntu-24.04-arm", True), ("ubuntu-gpu", False), ("self-hosted", False),
    (["linux", "gpu", "h100"], False), ("gpu", False),
    (["ubuntu-latest", "gpu"], False), ({"group": "gpu-runners"}, False),
    ({"group": "hosted", "labels": ["ubuntu-latest"]}, False), ("${{ matrix.os }}", False),
    (["ubuntu-latest", "${{ matrix.os }}"], False), (None, False), ([], False),
])
def test_self_hosted_unless_every_label_is_hosted(runs_on: object, hosted: bool) -> None:
    assert self_hosted({"runs-on": runs_on}) is not hosted


def test_gpu_labels_without_self_hosted_are_reported() -> None:
    """runs-on: [linux, gpu, h100] reaches the self-hosted runners without naming self-hosted."""
    wf = _doctored(perf=None)
    wf["jobs"]["perf"]["runs-on"] = ["linux", "gpu", "h100"]
    assert "self-hosted job 'perf' runs on: fork PR opened, no label" in fork_problems(wf)
    assert "self-hosted job 'perf' can read secrets" in secret_problems(
        {"jobs": {"perf": {"runs-on": "gpu", "env": {"T": "${{ secrets.T }}"}}}})


@pytest.mark.parametrize("uses", ["./.github/workflows/gpu-job.yml",
                                  "other/repo/.github/workflows/gpu.yml@11bd71901bbe5b1630ceea73d27597364c9af683"])
def test_reusable_workflow_is_refused(uses: str) -> None:
    """A called workflow's jobs are not evaluated, so a call is refused, guarded or not; so is a
    self-hosted workflow that others may call."""
    wf = load("gpu-perf.yml")
    wf["jobs"]["call"] = {"if": wf["jobs"]["perf"]["if"], "uses": uses}
    msg = f"job 'call' calls the reusable workflow {uses}: the checker does not follow reusable workflows"
    assert fork_problems(wf) == [msg]
    hosted = {True: {"push": None}, "jobs": {"call": {"uses": uses}}}
    assert fork_problems(hosted) == [msg]
    wf = load("gpu-perf.yml")
    wf[True]["workflow_call"] = None
    assert fork_problems(wf) == ["trigger workflow_call: the checker does not follow reusable workflows"]


def test_every_declared_action_is_simulated() -> None:
    """Fork events beyond opened/synchronize/reopened: each declared type is tried."""
    wf = _doctored(perf="github.event_name != 'pull_request' || github.event.action == 'ready_for_review'"
                        " || (github.event.action == 'labeled' && github.event.label.name == 'gpu-perf-approved')")
    wf[True]["pull_request"]["types"].append("ready_for_review")
    assert fork_problems(wf) == ["self-hosted job 'perf' runs on: fork PR ready_for_review, approval label on it",
                                 "self-hosted job 'perf' runs on: fork PR ready_for_review, no label"]
    wf = _doctored(perf=f"github.event_name != 'pull_request' || github.event.label.name == '{APPROVAL_LABEL}'")
    wf[True]["pull_request"]["types"].append("unlabeled")
    assert fork_problems(wf) == ["self-hosted job 'perf' runs on: fork PR unlabeled, the approval label removed"]
    wf[True]["pull_request"] = None  # the default types, labeled not among them
    assert fork_problems(wf) == []
    assert list(scenarios(wf))[:6] == [f"fork PR {a}, {s}" for a in ("opened", "reopened", "synchronize")
                                       for s in ("approval label on it", "no label")]


def test_concurrency_guard_copy_is_checked() -> None:
    """A skipped run left in the approved run's group would replace that run while it waits."""
    wf = load("gpu-perf.yml")
    group = wf["concurrency"]["group"]
    wf["concurrency"]["group"] = group.replace(" && github.event.label.name == 'gpu-perf-approved'", "")
    assert wf["concurrency"]["group"] != group
    assert concurrency_problems(wf) == ["fork PR labeled with another label, approval label on it"]
    wf["concurrency"]["group"] = "gpu-perf-${{ github.ref }}"
    assert concurrency_problems(wf) == [s for s, (_, allowed) in scenarios(wf).items() if not allowed]


@pytest.mark.parametrize("trigger", sorted(FORBIDDEN_TRIGGERS))
def test_dangerous_trigger_is_reported(trigger: str) -> None:
    wf = load("gpu-perf.yml")
    wf[True][trigger] = None
    assert f"trigger {trigger} runs fork code with secrets or a write token" in fork_problems(wf)


def test_secret_is_reported() -> None:
    wf = load("gpu-perf.yml")
    wf["jobs"]["perf"]["env"] = {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
    wf["jobs"]["perf"]["steps"][0]["with"]["persist-credentials"] = True
    assert secret_problems(wf) == ["self-hosted job 'perf' can read secrets",
                                   "self-hosted job 'perf': checkout without persist-credentials: false"]


@pytest.mark.parametrize("uses", ["actions/checkout@v4",  # a tag moves
                                  "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683",  # no version
                                  "actions/checkout@11bd719 # v4.2.2"])  # a short SHA can collide
def test_unpinned_uses_is_reported(uses: str) -> None:
    text = (WORKFLOWS / "gpu-perf.yml").read_text(encoding="utf8")
    doctored = re.sub(r"actions/checkout@\S+ # v[\d.]+", uses, text, count=1)
    assert doctored != text
    assert pin_problems(doctored) == [f"not pinned to a commit with a version comment: - uses: {uses}"]


@pytest.mark.parametrize(("expr", "value"), [
    ("'a' == 'A'", True), ("null == ''", True), ("!(1 == 2) && 'x'", "x"), ("false || null", None),
    ("github.event.nothing.here == null", True), ("format('{0}-{1}', 'a', 1)", "a-1"),
])
def test_evaluator(expr: str, value: object) -> None:
    assert evaluate(parse(expr), PUSH, {}) == value


@pytest.mark.parametrize("expr", ["github.event.labels[0]", "a < b", "secrets.X == ''", "fromJSON('1')",
                                  "'a' 'b'", "(true", "format('{0}' 'x')", "contains(github.event.labels, 'x')"])
def test_evaluator_refuses_what_it_does_not_understand(expr: str) -> None:
    with pytest.raises(ExpressionError):
        parse(expr)
