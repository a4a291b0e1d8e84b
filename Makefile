# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: serve test install install-dev train-demo clean redis-server

# pip runs --quiet (its resolver output is noise here), so each long step says first what it does:
# a fresh install is silent for over a minute otherwise.
$(BIN)/python:
	@echo "creating $(VENV) and upgrading pip in it ..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned first and alone: its CPU wheel is on local disk; any other spec may pull CUDA.
$(STAMP): $(BIN)/python pyproject.toml
	@echo "installing torch and mmserve into $(VENV) (about 1.2 GB: about a minute from a local wheel cache, several when pip downloads) ..."
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

$(STAMP_DEV): $(STAMP)
	@echo "installing the dev extra into $(VENV) (about 1 GB more, triton included: about a minute) ..."
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)
install-dev: $(STAMP_DEV)

serve: $(STAMP)
	$(BIN)/mmserve serve --config config.toml

# the shared-cache tests start a real redis-server (Debian package redis-server; we run as root)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server) || \
		(echo "redis-server is missing and could not be installed: apt-get install -y redis-server" >&2; exit 1)

# tests/test_dynamo_router.py runs NVIDIA Dynamo's real KV router (`python -m dynamo.select_service`).
# Its wheel pins pydantic <= 2.13.5, so it gets a virtual environment of its own, not mmserve's:
# about 275 MB (one wheel, pydantic, uvloop), installed once
DYNAMO_VENV := .venv-dynamo
$(DYNAMO_VENV)/.installed:
	@echo "creating $(DYNAMO_VENV) with ai-dynamo-runtime (Dynamo's KV router for the tests: about 275 MB) ..."
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --quiet ai-dynamo-runtime==1.6.1
	touch $@

test: $(STAMP_DEV) redis-server $(DYNAMO_VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

train-demo: $(STAMP)
	$(BIN)/mmserve train-demo

clean:
	rm -rf $(VENV) $(DYNAMO_VENV)
