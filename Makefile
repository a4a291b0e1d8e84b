# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STAMP_DEV := $(VENV)/.installed-dev
# lm-eval (EleutherAI's harness) in an environment of its own, for tests/test_lm_eval_live.py: it
# runs `lm_eval --model local-completions` / `local-chat-completions` against a live server with
# only base_url and model (issue 41). Not in the dev extra, although a dry run into .venv moves none
# of its pins (it only adds packages): lm-eval[api] brings ~45 packages nothing else here uses
# (datasets, pyarrow, pandas, scipy, scikit-learn, nltk, evaluate, aiohttp, ...) into the
# environment the whole suite imports from, and every later lm-eval release would be resolved
# together with the torch/transformers/triton/smg pins. Its own environment also proves more: it has
# no torch, transformers or tokenizers, so whatever lm-eval tokenizes, the server tokenized.
# Cost, measured on the 2-core machine from the local wheel cache: ~760 MB, 62 s (80 s when busy),
# pip's upgrade included. The version is in the stamp's name: changing it reinstalls.
LMEVAL_VERSION := 0.4.13
LMEVAL_VENV := .venv-lmeval
STAMP_LMEVAL := $(LMEVAL_VENV)/.installed-$(LMEVAL_VERSION)

.PHONY: serve test install install-dev install-lm-eval train-demo clean redis-server

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

$(STAMP_LMEVAL):
	@echo "installing lm-eval $(LMEVAL_VERSION) into $(LMEVAL_VENV), its own environment for tests/test_lm_eval_live.py (about 760 MB: about 80 s) ..."
	rm -rf $(LMEVAL_VENV)
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install --quiet --upgrade pip
	$(LMEVAL_VENV)/bin/pip install --quiet 'lm-eval[api]==$(LMEVAL_VERSION)'
	touch $@

install: $(STAMP)
install-dev: $(STAMP_DEV)
install-lm-eval: $(STAMP_LMEVAL)

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

# MMSERVE_LM_EVAL: the lm_eval command the live lm-eval test runs (set, it must exist: no skip).
# Two pytest-xdist workers, a test file each at a time (its module fixtures built once): much of
# the suite waits on subprocesses, sockets and servers, so two workers on two cores took 55% of
# one worker's time (382 s in a clean clone's CI; one worker took 693 s the same evening).
test: $(STAMP_DEV) $(STAMP_LMEVAL) redis-server $(DYNAMO_VENV)/.installed
	MMSERVE_LM_EVAL=$(abspath $(LMEVAL_VENV))/bin/lm_eval $(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadfile tests

train-demo: $(STAMP)
	$(BIN)/mmserve train-demo

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) $(DYNAMO_VENV)
