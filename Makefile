# kernelgate: `make test` passes the tests, `make bench` times the kernels against the last commit
# (BASE) and prints the verdict, `make baseline` saves this machine's baseline. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kernelgate-installed
PYTEST := $(PY) -m pytest
# Extra pytest flags, e.g. `make bench BENCH_THREADS=0 PERF_ARGS="--perf-device cuda --perf-size full"`
# (a GPU runner: at torch's default threads, as its baselines are saved).
PERF_ARGS ?=
# make test starts many Python processes (xdist workers, pytester sessions, torchrun ranks, the CLIs):
# where the host sets PYTHONDONTWRITEBYTECODE, each would compile the modules it imports (torch's
# among them) and pytest's assertion rewrites anew. Empty, it lets the first process that imports a
# module cache it in __pycache__: only what runs is compiled (a third of the venv's 10k files).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install test lint correctness perf bench baseline report check-pytest-benchmark clean

install: $(STAMP)

# uv where it installs (3x faster than pip for torch's CUDA wheels), from the sources pip is
# configured with; pip where uv cannot (scripts/install.py). Nothing is byte-compiled ahead: see
# PYTHONDONTWRITEBYTECODE above. The editable install compiles kernels/_nontemporal.c in place
# (kernels.nontemporal's streaming stores), kernels/_rope.c (kernels.rope's one-pass rotation),
# kernels/_softmax.c (the fused attention's softmax), kernels/_standardize.c (kernels.standardize's passes), and perfgate's perfgate/src/perfgate/_roundtrip.c (the thread-placement probe) and _streamfill.c (the roofline's streamed write rate); a change to any
# installs again.
$(STAMP): pyproject.toml perfgate/pyproject.toml constraints.txt scripts/install.py kernels/_nontemporal.c kernels/_rope.c kernels/_softmax.c kernels/_standardize.c kernels/_clones.h perfgate/src/perfgate/_roundtrip.c perfgate/src/perfgate/_streamfill.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/install.py -c constraints.txt -e ./perfgate -e '.[test]'
	touch $(STAMP)

# ruff, and actionlint over the GitHub workflows (a broken workflow cannot land); zizmor audits
# them for security (unpinned actions, credentials, injection), offline, at its default persona;
# .github/tests evaluates their conditions against simulated events (no fork code on a GPU runner).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/actionlint
	$(VENV)/bin/zizmor --offline --no-progress .github/workflows
	$(PYTEST) .github/tests -q -p no:cacheprovider

# The tests that time nothing on every core (pytest-xdist, one torch thread a worker: two 2-thread
# OpenMP teams on 2 vCPUs spin against each other; worksteal: an idle worker takes queued tests from
# the busy one, so a long test left at the end does not hold the run); then the paced ones (perf
# sessions whose timed calls sleep, ratios set by the test; marker `paced`) one a core, with nothing
# CPU-bound beside them; then the timed ones (real kernels, clocks, bandwidth, host-load readings;
# marker `timed`) alone, so no other test shares the CPUs.
correctness: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTEST) correctness_tests perfgate/tests -q -m "not timed and not paced" -n auto --dist worksteal
	$(PYTEST) correctness_tests perfgate/tests -q -m paced -n auto --dist worksteal
	$(PYTEST) correctness_tests perfgate/tests -q -m timed

# The perf suite at smoke size, gated by its speedup floors. No baseline compare here: memory-bound
# ratios move with a shared host's bandwidth past the baseline tolerance (docs/gate.md); `make bench`
# compares.
# --perf-gated-only: what no floor judges (an ablation step, a peer with no floor over it) is
# left to `make bench BASE=`.
perf: $(STAMP)
	$(PYTEST) perf_tests -q --perf-size smoke --perf-require-floors --perf-gated-only $(PERF_ARGS)

test: lint correctness perf

# Main job: "did this change make a kernel slower?" Every kernel of ours timed in this tree and in
# BASE's library (default HEAD: an uncommitted edit against the last commit; a clean tree is an A/A
# check), pair by pair in worker processes of the same session (--perf-against, docs/perfgate.md);
# --perf-gated-only times only what that comparison, a floor or this machine's stored baseline
# judges. `make bench BASE=REV` compares with any revision; `make bench BASE=` times every row
# against its reference instead (the full speedup table). It runs at BENCH_THREADS torch threads: on
# the 2-vCPU hosts the baseline rule's false alarms and detections were measured at 1 and 2 threads
# (docs/gate.md), and 1 caught every 1.5x slowdown with the fewest false alarms. The CPU floors are
# set at torch's default threads, so `make test` gates them; `make bench BENCH_THREADS=0` runs at the
# default (floors and baseline both).
BENCH_THREADS ?= 1
BENCH_ARGS = $(if $(filter 0,$(BENCH_THREADS)),,--perf-threads=$(BENCH_THREADS))
BASE ?= HEAD
AGAINST_ARGS = $(if $(BASE),--perf-gated-only --perf-against=$(BASE),)
bench: $(STAMP)
	$(PYTEST) perf_tests -q --benchmark-compare --benchmark-json=bench.json $(BENCH_ARGS) $(AGAINST_ARGS) $(PERF_ARGS)
	$(PY) -m perfgate.report $$(find .benchmarks -name "*.json" ! -name limits.json | sort) bench.json --png bench.png --quiet

# Save a new baseline for this machine's fingerprint, named by commit: only from a clean tree,
# so the name says exactly which code was measured.
baseline: $(STAMP)
	@git diff --quiet HEAD -- || { echo "make baseline: the tree has uncommitted changes; commit first, so the baseline's name (the commit) says what was measured" >&2; exit 1; }
	$(PYTEST) perf_tests -q --benchmark-save=$$(git rev-parse --short HEAD) $(BENCH_ARGS) $(PERF_ARGS)

# The stored baselines' tables as docs/results.md (and the charts as bench.png).
report: $(STAMP)
	$(PY) -m perfgate.report --markdown docs/results.md --png bench.png

# perfgate leaves pytest-benchmark alone: pytest-benchmark's own test suite fails the same tests
# with perfgate installed as without (-p no:perfgate), in its own venv. PB_SRC: a pytest-benchmark
# checkout or sdist; by default pip fetches the installed version's sdist (before any test runs).
check-pytest-benchmark: $(STAMP)
	$(PY) perfgate/scripts/check_pytest_benchmark.py --venv .venv-pytest-benchmark $(if $(PB_SRC),--source $(PB_SRC))

clean:
	rm -rf $(VENV) .venv-pytest-benchmark .pytest_cache .hypothesis bench.json bench.png
