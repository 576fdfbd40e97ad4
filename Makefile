# Two commands for a newcomer: `make demo` (set up, run the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?= --procs 4 --steps 300 --fault kill@120:rank=2 --fault hang@200:rank=1

# `make bench`: every benchmark, peers (torchmonarch, ipyparallel) in bench/.peers-venv; JSON in bench/results/
.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml scripts/setup-venv.sh
	bash scripts/setup-venv.sh $(VENV)

setup: $(VENV)/.installed

demo: setup
	$(PY) -m monarch_nb.cli train $(DEMO_ARGS)

test: setup
	bash scripts/install-browser.sh
	bash scripts/install-gpu-compilers.sh
	bash scripts/install-test-daemons.sh
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/actor_latency.py --with-peers
	$(PY) bench/detection.py --with-peers
	$(PY) bench/training.py --chaos
	$(PY) bench/own_loop.py
	$(PY) bench/kernels.py
	$(PY) bench/multihost.py
	$(PY) bench/workspace_sync.py
	$(PY) bench/scale.py
	$(PY) bench/spmd.py
	$(PY) bench/tree_widget.py

clean:
	rm -rf $(VENV) bench/results test-artifacts
