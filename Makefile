# fedweave: the two quick-start commands are `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DOCS_STAMP := $(VENV)/.installed-docs
# The extras whose tests must run rather than skip: the Ray backend, Flower deployment, the three trackers,
# Sphinx for the API reference, Opacus for the privacy accountants.
TEST_EXTRAS := dev,ray,flower,tensorboard,mlflow,wandb,docs,privacy
# Exact versions of every dependency for our own runs (the package itself declares ranges).
CONSTRAINTS := constraints.txt
TEST_WORKERS ?= 3
# The data sets of the replay tests (tests/test_replay.py: committed reproduction cells run again), fetched and
# verified into the cache before the suite and named in FEDWEAVE_TEST_DATA, so that on a fresh machine a replay
# runs instead of skipping, and a data set that cannot be had fails its replay.
comma := ,
TEST_DATA := mnist,fashion_mnist,adult
# The tests marked slow (real Flower processes, a wheel installed into a fresh environment, killed sweeps, ...)
# run under CI (CI=true) or with `make test SLOW=1`; a plain `make test` leaves them out.
SLOW_TESTS := $(if $(CI)$(SLOW),,-m "not slow")

.PHONY: demo test bench lint docs venv test-venv lock clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@command -v $(PY) >/dev/null 2>&1 || { echo "python3.11 not found; set PY=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: other torch versions pull multi-GB CUDA wheels.
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

# Everything the test suite needs, at the versions of constraints.txt: `make test` on a fresh clone needs
# no other command (Debian's Chromium for the report's browser test is the one thing pip cannot install).
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[$(TEST_EXTRAS)]"
	touch $(TEST_STAMP)

# Sphinx for `make docs` alone (`make test` installs it with the other test extras).
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[docs]"
	touch $(DOCS_STAMP)

venv: $(STAMP)

test-venv: $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/fedweave data fetch mnist
	$(BIN)/fedweave run configs/demo.yaml --overwrite

# Three pytest workers (pytest-xdist: the real-process Flower tests mostly wait, so a third keeps both cores busy); FEDWEAVE_TEST_EXTRAS makes a missing optional package a failure, not a skip.
test: $(TEST_STAMP)
	$(BIN)/fedweave data fetch $(subst $(comma), ,$(TEST_DATA))
	FEDWEAVE_TEST_EXTRAS=$(TEST_EXTRAS) FEDWEAVE_TEST_DATA=$(TEST_DATA) $(BIN)/python -m pytest -n $(TEST_WORKERS) $(SLOW_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/population.py

# The API reference, generated from the docstrings (docs/api), with warnings as errors as the test suite builds it.
docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -b html docs/api build/api
	@echo "open build/api/index.html"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports --no-cache

# Refresh constraints.txt: resolve the declared ranges (with every extra CI installs) in a fresh
# environment and freeze what was installed. Review the diff, run `make test`, commit.
lock:
	rm -rf build/lock-venv
	$(PY) -m venv build/lock-venv
	build/lock-venv/bin/pip install -q --upgrade pip
	build/lock-venv/bin/pip install -q torch==$$(sed -n 's/^torch==//p' $(CONSTRAINTS))
	build/lock-venv/bin/pip install -q ".[$(TEST_EXTRAS),bench]"
	( echo "# Exact versions for fedweave's own CI and Makefile: make lock (docs/development.md)."; \
	  build/lock-venv/bin/pip freeze --exclude fedweave | sed 's/+cpu$$//' ) > $(CONSTRAINTS)
	rm -rf build/lock-venv

clean:
	rm -rf $(VENV) build *.egg-info
