# The two commands a newcomer runs: `make demo` and `make test`. Each does its own set-up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch lies on disk; asking for it by exact version keeps pip from fetching a CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install demo test serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py registry/_grouping.c registry/_busguard.c registry/client/_mapfiles.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,server,torch]"
	touch $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest -q

serve: install
	$(BIN)/mfsreg serve --host 127.0.0.1 --port 8700

bench: install
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.bench_core
	$(BIN)/python -m benchmarks.bench_delta
	$(BIN)/python -m benchmarks.bench_api
	$(BIN)/python -m benchmarks.bench_node
	$(BIN)/python -m benchmarks.page_mapping
	$(BIN)/python -m benchmarks.bench_prune
	$(BIN)/python -m benchmarks.bench_check
	$(BIN)/python -m benchmarks.bench_trained

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info registry/*.so registry/client/*.so dist site
