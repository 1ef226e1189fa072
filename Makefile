# Everything installs from nothing into .venv; `make test` and `make demo` are the two entry points.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast demo clean

install: $(STAMP)

# torch is installed first and pinned: on a CPU machine 2.13.0 resolves to the local CPU wheel,
# and every later resolve sees it satisfied instead of fetching a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

demo: $(STAMP)
	$(BIN)/echo2swarm demo

clean:
	rm -rf $(VENV) runs .pytest_cache
