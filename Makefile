# The two README commands: `make demo` and `make test`. Both set up .venv/ first (idempotent).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup demo demo-cluster test test-slow lint typecheck pytest fuzz bench clean

setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) examples/multi_turn_chat.py --launch --workdir .demo

# Two servers on one tier behind the router: a turn restored on the server that never saw it.
# `make demo-cluster CLUSTER_FLAGS=--mooncake`: the servers share a Mooncake Store instead.
CLUSTER_FLAGS ?=
demo-cluster: setup
	$(PY) examples/cluster.py --workdir .demo-cluster $(CLUSTER_FLAGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy sgl_hicache kernels/sgl_hicache_kernels cpu/sgl_hicache_cpu benchmarks/bench benchmarks/modelgen

# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
pytest: setup
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test: lint typecheck pytest

# The tests `make test` leaves out to keep CI within its time (pyproject.toml, marker `slow`).
test-slow: setup
	$(PY) -m pytest -m slow

# The model-based cache test at nightly size (make test runs it at CI size): ~20x the examples.
FUZZ_EXAMPLES ?= 400
fuzz: setup
	SGL_HICACHE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/cache/test_stateful.py tests/cache/test_exactness.py

bench: setup
	$(PY) -m sgl_hicache.bench --quick

clean:
	rm -rf .demo .demo-cluster out .pytest_cache .mypy_cache .ruff_cache
