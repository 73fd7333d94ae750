"""The repository's layout holds: everything about X is found by its name, imports run one way
(tests -> workloads -> reference -> kernels; perfgate stands apart), no import circle, reference/
computes nothing with kernels/ code (it takes validators and the contract's types only), and the
library warns when another distribution shares its import name."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parents[1]

# Every module without its full set of mirrored files, and why: the one place these are listed.
EXCEPTIONS: dict[str, str] = {
    "kernels/checks.py": "the argument validators every kernel shares: no slow counterpart; tested with the "
                         "walk of every public name (test_checks.py); their cost is in each kernel's row",
    "kernels/ghost.py": "internal to per_sample (the ghost Gram terms): tested and timed through per_sample",
    "kernels/layer_capture.py": "internal to per_sample (captures Linear inputs and output grads)",
    "kernels/nontemporal.py": "a way of writing per_sample's outer products, torch.mul's bits "
                              "(test_nontemporal.py): no slow counterpart; its effect is per_sample's rows",
    "kernels/hugepages.py": "an allocation with no slow counterpart: tested by the advice it leaves and the "
                            "pages it faults (test_hugepages.py); its effect is per_sample's and standardize's "
                            "rows under --perf-malloc default",
    "kernels/cpu.py": "reads the CPU's vendor for kernels.attention's path lengths and its hypervisor flag for "
                      "kernels.hugepages: no slow counterpart; tested on written cpuinfo files (test_cpu.py); "
                      "its effect is those kernels' rows",
    "kernels/feature_cache.py": "a cache has no slow counterpart: its test compares cached to recomputed; "
                                "timed as spectral_probe's cached rerun",
    "kernels/training.py": "timed as the workloads' steps (perf_tests/test_cifar_resnet.py, ...)",
    "kernels/determinism.py": "a switch, not a computation: tested by two runs being bitwise equal; its cost is "
                              "the CIFAR ablation's 'auto, deterministic' row",
    "kernels/distributed.py": "wires the engine to torch.distributed: its reference is one process at the "
                              "global batch (correctness_tests/test_distributed.py); its cost: "
                              "workloads/data_parallel.py",
    "workloads/data_parallel.py": "measures two workloads on 1 and N processes (DDP's cost on one host is not a "
                                  "speedup to gate); its CLI is run in correctness_tests/test_distributed.py",
    "workloads/common.py": "table formatting and config checks shared by the workloads",
    "workloads/cifar_data.py": "the CIFAR input pipeline: compared with preloaded tensors in the CIFAR "
                               "ablation's DataLoader rows",
    "workloads/output.py": "--output-dir's files: nothing to compare or time",
    "workloads/rotated_digits.py": "OCS's data: tested in correctness_tests/test_ocs.py",
    "workloads/ocs_ablation.py": "the OCS ablation: tested in correctness_tests/test_ocs.py",
    "workloads/meta_reweight_ablation.py": "the Meta-Weight-Net ablation: tested in test_meta_reweight.py",
    "correctness_tests/test_perfgate_suite.py": "checks the perf suite's floors against their evidence",
    "correctness_tests/test_install.py": "tests scripts/install.py, make install's installer",
    "correctness_tests/test_layout.py": "this file: the layout itself",
    "correctness_tests/test_c_parts.py": "the C parts of kernels/ (kernels/_*.c) together: each built where there "
                                         "is a compiler, each on torch's OpenMP team",
}


def _mirrors(path: str) -> list[str]:
    """The files a module of kernels/ or workloads/ should have beside it, by name."""
    name = Path(path).stem
    ref = f"reference/{name}.py" if path.startswith("kernels/") else f"reference/workloads/{name}.py"
    return [ref, f"correctness_tests/test_{name}.py", f"perf_tests/test_{name}.py"]


def _modules(folder: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob("*.py") if not p.name.startswith("_"))


def test_every_module_is_found_by_its_name() -> None:
    missing = [f"{m}: no {f}" for m in _modules("kernels") + _modules("workloads")
               if m not in EXCEPTIONS for f in _mirrors(m) if not (ROOT / f).is_file()]
    assert not missing, "add the mirrored file, or list the module in EXCEPTIONS with why:\n" + "\n".join(missing)


def test_every_test_names_a_module() -> None:
    """correctness_tests/test_X.py and perf_tests/test_X.py each test a kernels/X.py or workloads/X.py."""
    orphans = [t for t in _modules("correctness_tests") + _modules("perf_tests")
               if Path(t).name.startswith("test_") and t not in EXCEPTIONS
               and not any((ROOT / d / f"{Path(t).stem.removeprefix('test_')}.py").is_file()
                           for d in ("kernels", "workloads"))]
    assert not orphans, f"tests named after no module: {orphans}"


def test_exceptions_are_current() -> None:
    """An exception for a file that is gone, or that now has all its mirrors, is removed."""
    stale = [p for p in EXCEPTIONS if not (ROOT / p).is_file()
             or (p.startswith(("kernels/", "workloads/")) and all((ROOT / f).is_file() for f in _mirrors(p)))]
    assert not stale, f"stale EXCEPTIONS entries: {stale}"


# -- imports ------------------------------------------------------------------------------------

PACKAGES = {"kernels": ROOT / "kernels", "reference": ROOT / "reference", "workloads": ROOT / "workloads",
            "perfgate": ROOT / "perfgate" / "src" / "perfgate"}
# What each package may import of the others (itself always): the one-way rule.
ALLOWED = {"kernels": set(), "reference": {"kernels"}, "workloads": {"kernels", "reference", "perfgate"},
           "perfgate": set()}


def _module_name(path: Path) -> str:
    for package, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports anywhere in its file (in functions and under
    TYPE_CHECKING too: a lazy import is still a dependency)."""
    files = {_module_name(p): p for folder in PACKAGES.values() for p in folder.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the submodule pkg.mod where there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != module}
        graph[module] = edges
    return graph


def test_imports_run_one_way() -> None:
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() for t in targets
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not wrong, "imports against the layering (tests -> workloads -> reference -> kernels; " \
                      "perfgate apart):\n" + "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph, state, cycles = import_graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_graph_sees_imports() -> None:
    """The checks above are not vacuous: known edges are in the graph."""
    graph = import_graph()
    assert "kernels.ghost" in graph["kernels.per_sample"]
    assert "reference.workloads.ocs" in graph["workloads.ocs"]
    assert "perfgate.compat" in graph["perfgate.session"]  # relative import resolved
    assert "perfgate.timing" in graph["workloads.vit_rope"]


# -- what reference/ may take from kernels/ ----------------------------------------------------------

# The contract's types and constants; besides these only validators (kernels.checks, and a kernel
# module's check_* functions: one set of checks), so no bug in a kernel's arithmetic is on both sides.
CONTRACT = {"EPS", "LossClosure", "LossFn", "Memory", "Recipe", "TrainResult"}


def borrowed(source: str) -> list[str]:
    """What ``source`` (a module of reference/) imports from kernels/ beyond CONTRACT and validators."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            wrong += [a.name for a in node.names
                      if a.name.split(".")[0] == "kernels" and a.name != "kernels.checks"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kernels":
            wrong += [f"{node.module}.{a.name}" for a in node.names
                      if not (a.name in CONTRACT or a.name.lstrip("_").startswith("check")
                              or node.module == "kernels.checks")]
    return wrong


def test_reference_computes_nothing_with_kernel_code() -> None:
    wrong = {str(p.relative_to(ROOT)): borrowed(p.read_text(encoding="utf8"))
             for p in sorted((ROOT / "reference").rglob("*.py"))}
    assert not {k: v for k, v in wrong.items() if v}, f"reference/ computes with kernels/ code: {wrong}"


def test_a_borrowed_computation_is_caught() -> None:
    """The check above is not vacuous: an injected kernel import, of either form, is named."""
    source = ("from kernels import checks\nfrom kernels.rope import check_rotate, rope_angles\n"
              "import kernels.optim\n")
    assert borrowed(source) == ["kernels.rope.rope_angles", "kernels.optim"]
    injected = (ROOT / "reference" / "rope.py").read_text(encoding="utf8")
    injected += "from kernels.rope import rope_angles\n"
    assert borrowed(injected) == ["kernels.rope.rope_angles"]


def test_perf_tests_time_public_names() -> None:
    """A perf row times what a user can call: no private name of the library is imported."""
    private = [f"{p.name}: {node.module}.{a.name}" for p in sorted((ROOT / "perf_tests").glob("*.py"))
               for node in ast.walk(ast.parse(p.read_text(encoding="utf8")))
               if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES
               for a in node.names if a.name.startswith("_")]
    assert not private, f"perf tests import private names: {private}"


# -- the import name `kernels` ---------------------------------------------------------------------

def test_conflicting_kernels_distribution_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With Hugging Face's `kernels` installed (a dist-info on the path), importing ours warns,
    naming the other distribution and the fix."""
    info = tmp_path / "kernels-0.17.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.17.2\n"
                                   "Summary: Download compute kernels\n", encoding="utf8")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    match = r"'kernels' distribution.*separate virtual environments"
    with pytest.warns(kernels.KernelsConflictWarning, match=match):
        kernels._check_conflict()


def test_no_warning_without_the_other_distribution() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels._check_conflict()


# -- the docs' links ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slugs(page: Path) -> set[str]:
    """GitHub's anchors for ``page``'s headings (lower case, punctuation dropped, spaces as '-')."""
    slugs = set()
    for line in _prose(page):
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


def _prose(page: Path) -> list[str]:
    """``page``'s lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf8").splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and not line.lstrip().startswith("```"):
            lines.append(line)
    return lines


def broken_links(pages: list[Path]) -> list[str]:
    """Each relative link of ``pages`` whose file, or heading anchor, does not exist."""
    broken = []
    for page in pages:
        name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
        for target in (m.group(1) for line in _prose(page) for m in LINK.finditer(line)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                broken.append(f"{name}: {target} (no such heading)")
    return broken


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "perfgate" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "evidence").rglob("*.md"))]


def test_docs_links_resolve() -> None:
    broken = broken_links(_pages())
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A heading\n[ok](#a-heading) [gone](missing.md) [bad](#nowhere)\n"
                    "```\n[in code](skipped.md)\n```\n", encoding="utf8")
    assert [b.split(": ", 1)[1] for b in broken_links([page])] == ["missing.md (no such file)",
                                                                    "#nowhere (no such heading)"]
