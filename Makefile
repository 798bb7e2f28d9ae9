# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.core
STAMP := $(VENV)/.installed
OPS_STAMP := $(VENV)/torch_extensions/.built
# Pinned here (not in pyproject.toml, which says torch>=2.3 for users) so that the install
# step takes the CPU wheel and never resolves to a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# Framework versions the integration tests run against (users get open ranges from the extras).
# Installed with the torch pin so that pip can never swap the CPU torch for another build.
INTEGRATION_PINS := lightning==2.6.6 transformers==5.24.0 accelerate==1.15.0
# DeepSpeed for tests/parallel/test_deepspeed.py (CPU accelerator, gloo), with the torch pin.
DEEPSPEED_PINS := deepspeed==0.19.8
# torchtitan for tests/parallel/test_pipeline.py (its split and clip_grad_norm_ are the
# reference), with the torch pin.
TORCHTITAN_PINS := torchtitan==0.3.0
# DeepSpeed's C++ ops (shared-memory comm, CPU Adam) build into this venv, not a cache that other
# checkouts share: a shared one is rebuilt whenever another venv built it last, and a process
# killed mid-build leaves a lock there that every later load waits on (tests/conftest.py sets
# the same path when pytest runs without make).
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
PYTEST_ARGS ?=
# pytest-xdist: each test file whole on one worker (its module fixtures start once). Most of the
# suite waits (on ranks' rendezvous, scrape intervals, `for:` durations) rather than computes,
# so more workers than cores overlap those waits; PYTEST_XDIST= runs it in one process. Files
# run longest first (tests/durations.json, tests/conftest.py), not xdist's most-tests-first.
PYTEST_XDIST ?= -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The suite starts a few hundred Python processes (ranks, torchrun agents, CLIs), each importing
# torch: 4 CPU-s from bytecode, 10 compiled from source. A caller's PYTHONDONTWRITEBYTECODE
# (or a venv whose __pycache__ was swept) would make every one of them compile torch again, so
# the test runs write bytecode: only the first process to import a module compiles it.
PYTEST_ENV := PYTHONDONTWRITEBYTECODE=
TEST_WORKERS ?= 3
# The fast lane (`make check`): no subprocess ranks, no Debian package, no browser.
FAST_LANE := not ranks and not services and not browser and not gpu and not long
# The default demo injects a NaN on rank 1 so the summary shows where it originated.
DEMO_ARGS ?= --inject nan@rank1:step60

.PHONY: demo demo-pp gpu-check test test-deps check check-deps docs reference lint replica-soak bench bench-before-after bench-dashboards bench-dashboards-4096 bench-dashboards-16384 bench-stragglers stack rules dashboards debs clean multinode scaleout

# Two install levels. CORE: torch and ddpmon's own dependencies, all `make demo` needs. TEST
# (the default stamp): CORE plus the extras, the frameworks the integration tests drive and the
# dev tools (pytest, ruff, mkdocs, playwright...).
PIP := $(BIN)/pip install --quiet --disable-pip-version-check
DS_STAMP := $(VENV)/.deepspeed
OPS_PINS := $(VENV)/deepspeed-ops-pins.txt

# pip byte-compiles the ~6,600 files it installs one at a time, on one core (20 of the 34 s
# this step took on 2 cores); compileall does the same compilation on every core (13 s). Torch
# ships one file written for Python 3.12 (a test helper that nothing imports), which pip skips
# silently: it is excluded by name, so any other file that fails still fails the install.
COMPILE_SKIP := torch/testing/_internal/py312_intrinsics\.py
$(CORE_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) --no-compile $(TORCH_PIN) -e .
	$(BIN)/python -m compileall -q -j 0 -x '$(COMPILE_SKIP)' \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $(CORE_STAMP)

# DeepSpeed alone first, so that its C++ ops (below) build while pip installs the rest: pip runs
# on one core, the build on both. The rest's pip run takes the versions of everything the
# build imports as constraints (scripts/deepspeed_ops.py), so it cannot swap a package under
# the build.
$(DS_STAMP): $(CORE_STAMP)
	$(PIP) $(TORCH_PIN) $(DEEPSPEED_PINS)
	$(BIN)/python scripts/deepspeed_ops.py pins $(OPS_PINS)
	touch $(DS_STAMP)

# One pip run for the rest: one resolution instead of three.
$(STAMP): $(DS_STAMP)
	$(PIP) -c $(OPS_PINS) $(TORCH_PIN) $(INTEGRATION_PINS) $(DEEPSPEED_PINS) $(TORCHTITAN_PINS) \
	  -e '.[daemon,auth,dashboards,dev,lightning,transformers,deepspeed]'
	touch $(STAMP)

# DeepSpeed's CPU backend JIT-builds its shared-memory comm op at the first
# deepspeed.initialize, and its CPU Adam at the first optimizer offload (about a minute of g++
# each, into $TORCH_EXTENSIONS_DIR): build them here, once, as DS_BUILD_OPS would, rather than
# inside the first test that needs them (where a test timeout could kill the build).
$(OPS_STAMP): $(DS_STAMP)
	$(BIN)/python scripts/deepspeed_ops.py build
	touch $(OPS_STAMP)

# What `make test` and `make check` need, made three at a time: the Debian packages and
# DeepSpeed's ops build beside pip.
test-deps: $(STAMP) $(OPS_STAMP) debs
check-deps: $(STAMP) $(OPS_STAMP)

debs:
	@bash scripts/install-debs.sh

demo: $(CORE_STAMP)
	$(BIN)/ddpmon demo $(DEMO_ARGS)

# Pipeline parallel x FSDP2 on 4 CPU ranks (examples/pp_fsdp2.py): one global norm beside
# torchtitan's, the last stage's loss, per-op collective times, the NaN origin's stage and rank.
PP_DEMO_ARGS ?= --steps 8
demo-pp: $(CORE_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 4 examples/pp_fsdp2.py $(PP_DEMO_ARGS)

# CI=true (set by CI) turns a skipped test into a failure (tests/conftest.py): everything the
# suite needs is installed here, so a skip would be coverage that did not run.
test:
	@$(MAKE) --no-print-directory -j3 --output-sync=target test-deps
	$(BIN)/ruff check .
	CI=$${CI:-true} $(PYTEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

# ruff and the unit tests at world size 1 (tests/conftest.py's lanes): no Debian package, no
# subprocess rank; about a minute on 2 cores.
check:
	@$(MAKE) --no-print-directory -j3 --output-sync=target check-deps
	$(BIN)/ruff check .
	$(PYTEST_ENV) $(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder \
	  -m "$(FAST_LANE)" $(PYTEST_ARGS)

# The docs site (MkDocs + Material) into site/; the tests build it with --strict too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Regenerate docs/reference/*.md and docs/index.md from the code (the tests fail when stale).
reference: $(STAMP)
	$(BIN)/python -m ddpmon.reference --write

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP) $(OPS_STAMP)
	$(BIN)/python benchmarks/host_cost.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/host_cost_vs_first.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/norm_precision.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/overhead.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/fsdp_overhead.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/deepspeed_overhead.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/pp_overhead.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/replica_check.py --write benchmarks/RESULTS.md
	$(BIN)/python benchmarks/rerun_cost.py --write benchmarks/RESULTS.md

# make bench's overhead ratios under an older ddpmon (BEFORE, a commit: its package from git
# archive) and this checkout, side by side in rounds, into benchmarks/RESULTS.md
# (benchmarks/before_after.py; ed0588e is the commit before issue 47's reshape).
# BEFORE_AFTER_ARGS passes options (--rounds N, --benches host_cost ddp fsdp pp deepspeed).
BEFORE ?= ed0588e
BEFORE_AFTER_ARGS ?=
bench-before-after: $(STAMP)
	$(BIN)/python benchmarks/before_after.py --before $(BEFORE) --write benchmarks/RESULTS.md \
	  $(BEFORE_AFTER_ARGS)

# Everything that needs a GPU, in one call (scripts/gpu_check.py): tests/gpu, the sync audit under
# CUDA's sync debug mode, NVML readings and the overhead benchmark on the largest model that fits
# one GPU, into gpu-check.json, within 8 minutes. Without CUDA it skips those steps, one line each.
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --out gpu-check.json $(GPU_CHECK_ARGS)

stack: $(STAMP) debs
	$(BIN)/ddpmon stack

# The scale-out path on this machine (docs/scale-out.md): two vmagent shards -> VictoriaMetrics
# <- vmalert -> Alertmanager, a 4-rank demo with a NaN on rank 1 through it, the pages printed,
# then the dashboard figures at scale from benchmarks/RESULTS.md. SCALEOUT_ARGS passes options.
SCALEOUT_ARGS ?=
scaleout: $(STAMP) debs
	$(BIN)/ddpmon scaleout $(SCALEOUT_ARGS)

rules: $(STAMP)
	$(BIN)/ddpmon rules --write

dashboards: $(STAMP)
	$(BIN)/ddpmon dashboards --write

# Long clean runs under every strategy with replicas (DDP, HSDP, ZeRO-2; fp32 and bf16 with
# accumulation): the replica checksums must report no mismatch (docs/parallelism.md).
SOAK_ARGS ?= --steps 10000 --every 10
replica-soak: $(STAMP) $(OPS_STAMP)
	$(BIN)/python scripts/replica_soak.py $(SOAK_ARGS)

bench-dashboards: $(STAMP) debs
	$(BIN)/python benchmarks/dashboards_scale.py --write-results

# The same at 4,096 ranks (heavy: ~4x the samples; its own section in benchmarks/RESULTS.md).
bench-dashboards-4096: $(STAMP) debs
	$(BIN)/python benchmarks/dashboards_scale.py --ranks 4096 --write-results

# 16,384 ranks on VictoriaMetrics (the store past one Prometheus), series_profile=large, with
# every rule group's evaluation time (~16x the 1,024-rank samples: the better part of an hour
# on 2 shared cores; BENCH16K_ARGS="--store prometheus" for one Prometheus, if it fits).
bench-dashboards-16384: $(STAMP) debs
	$(BIN)/python benchmarks/dashboards_scale.py --ranks 16384 --store victoria-metrics \
	  --series-profile large --rule-times --write-results $(BENCH16K_ARGS)

# Issue 48 at scale: a 5 % straggler and a hang among simulated ranks through the shipped rules,
# on one Prometheus and on VictoriaMetrics (benchmarks/straggler_scale.py; docs/slow-and-stuck/
# stragglers.md#at-scale). STRAGGLER_RANKS=16384 for the README's figures (about 20 minutes a
# store on 2 shared cores).
STRAGGLER_RANKS ?= 1024
bench-stragglers: $(STAMP) debs
	$(BIN)/python benchmarks/straggler_scale.py --ranks $(STRAGGLER_RANKS) --store prometheus
	$(BIN)/python benchmarks/straggler_scale.py --ranks $(STRAGGLER_RANKS) --store victoria-metrics

# Two nodes on this machine (network namespaces, needs root): torchrun across them, a daemon
# per node, one Prometheus; prints what each check sees (tests/multinode).
multinode: $(STAMP) debs
	CI=$${CI:-true} $(BIN)/python -m pytest tests/multinode -s -v -rs -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info ddpmon-runs site
