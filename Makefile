# The two commands a newcomer runs: `make demo` and `make test`. Each does its own set-up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch lies on disk; asking for it by exact version keeps pip from fetching a CUDA build.
TORCH   ?= torch==2.13.0
# pytest-xdist workers: two per core, since many tests wait (on servers, subprocesses, timeouts);
# keeps a module marked xdist_group on one worker, where its fixture is built once
WORKERS ?= $(shell $(PY) -c "import os; print(2 * (os.cpu_count() or 1))")
# mypy reads the package through links that place the folders under mfsreg/, as the wheel does
TYPECHECK := build/typecheck

.PHONY: install demo test test-fast lint docs serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py registry/format/_grouping.c registry/format/_busguard.c registry/client/_mapfiles.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,server,torch]"
	touch $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

# every test, on SQLite and the Postgres server, moto's S3 server and uvicorn on loopback
test: install
	$(BIN)/python -m pytest -q -n $(WORKERS)

# the edit loop: no Postgres, no S3, no spawned processes
test-fast: install
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not services and not process"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/mfsreg
	ln -s $(CURDIR)/mfsreg/__init__.py $(CURDIR)/mfsreg/__main__.py $(TYPECHECK)/mfsreg/
	for d in registry api cli migrations; do ln -s $(CURDIR)/$$d $(TYPECHECK)/mfsreg/$$d; done
	MYPYPATH=$(TYPECHECK) $(BIN)/mypy -p mfsreg

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve: install
	$(BIN)/mfsreg serve --host 127.0.0.1 --port 8700

bench: install
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.cli_startup
	$(BIN)/python -m benchmarks.bench_core
	$(BIN)/python -m benchmarks.bench_delta
	$(BIN)/python -m benchmarks.decode_kernels
	$(BIN)/python -m benchmarks.bench_api
	$(BIN)/python -m benchmarks.bench_node
	$(BIN)/python -m benchmarks.bench_ready
	$(BIN)/python -m benchmarks.bench_hub
	$(BIN)/python -m benchmarks.page_mapping
	$(BIN)/python -m benchmarks.bench_prune
	$(BIN)/python -m benchmarks.bench_check
	$(BIN)/python -m benchmarks.bench_trained

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info registry/*.so registry/client/*.so site
