# Two commands for a fresh machine: `make run` (the whole platform) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test venv deploy-schemas browser-checks lint smoke clean

$(BIN)/.installed: requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

venv: $(BIN)/.installed

# The Kubernetes manifests' schema packages (tests/deploy/package-lock.json); without node, tests/deploy
# skips its schema check and says why.
tests/deploy/node_modules/.installed: tests/deploy/package-lock.json
	if command -v npm >/dev/null 2>&1; then npm ci --prefix tests/deploy --no-audit --no-fund && touch $@; fi

deploy-schemas: tests/deploy/node_modules/.installed

# axe-core (tests/browser/package-lock.json), injected into the pages by the accessibility checks; without
# node, those checks skip and say why.
tests/browser/node_modules/.installed: tests/browser/package-lock.json
	if command -v npm >/dev/null 2>&1; then npm ci --prefix tests/browser --no-audit --no-fund && touch $@ \
	  || echo "axe-core could not be installed: the accessibility check skips (and fails under CI=true)"; fi

browser-checks: tests/browser/node_modules/.installed

## Start Redis (if REDIS_URL does not answer), web, online and offline workers and Flower; Ctrl-C stops all.
run: venv
	$(BIN)/python scripts/run.py

## Run the whole test suite on real Redis, real worker processes and a real database.
test: venv deploy-schemas browser-checks
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

## 16 concurrent clients for 10 s against a running `make run` stack.
smoke: venv
	$(BIN)/python -m benchmarks.smoke

clean:
	rm -rf $(VENV) var staticfiles
