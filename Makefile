# fedweave: the two quick-start commands are `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exact versions of every dependency for our own runs (the package itself declares ranges).
CONSTRAINTS := constraints.txt

.PHONY: demo test bench lint venv lock clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@command -v $(PY) >/dev/null 2>&1 || { echo "python3.11 not found; set PY=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: other torch versions pull multi-GB CUDA wheels.
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedweave data fetch mnist
	$(BIN)/fedweave run configs/demo.yaml --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/population.py

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
	build/lock-venv/bin/pip install -q ".[dev,ray,bench,flower,tensorboard,mlflow,wandb]"
	( echo "# Exact versions for fedweave's own CI and Makefile: make lock (docs/development.md)."; \
	  build/lock-venv/bin/pip freeze --exclude fedweave | sed 's/+cpu$$//' ) > $(CONSTRAINTS)
	rm -rf build/lock-venv

clean:
	rm -rf $(VENV) build *.egg-info
