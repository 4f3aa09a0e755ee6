# Two commands from a fresh clone: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The CPU wheel of torch lives on these machines; an unpinned torch would pull a CUDA build.
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]' $(TORCH)
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvstate memory

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

bench: $(STAMP)
	$(BIN)/kvstate bench ops

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
