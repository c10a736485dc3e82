# Two commands on a fresh machine: `make demo` and `make test` (each creates .venv on first use).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench bench-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# PyPI's Linux torch wheel pulls in CUDA (GBs): prefer the CPU build (2.13.0+cpu sorts above
	# 2.13.0 where a CPU wheel is on the index or in find-links; elsewhere this is PyPI's 2.13).
	# Elsewhere: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
	if [ "$$(uname -s)" = Linux ]; then $(VENV)/bin/pip install -q "torch>=2.13,<2.14"; fi
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m mlx_tandem.demo

# Test files run in parallel, each file whole on one worker (--dist loadfile: a file's
# module-scoped models are built once), in collection order (tests/conftest.py puts the
# files that take minutes first; xdist's default order is by test count). One BLAS thread a
# worker, so two workers use two cores without OpenBLAS's threads spinning against each
# other. TEST_WORKERS=0: one process. --durations: the slowest tests, in CI's log, for
# whoever next trims the suite's time.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

bench: $(VENV)/.installed
	$(PY) benchmarks/batching.py benchmarks/results/batching.json
	$(PY) benchmarks/mtp.py benchmarks/results/mtp.json
	$(PY) benchmarks/long_prompts.py benchmarks/results/long_prompts.json
	$(PY) benchmarks/admission.py benchmarks/results/admission.json
	$(PY) benchmarks/structured.py benchmarks/results/structured.json
	$(PY) benchmarks/vision_prefix.py benchmarks/results/vision_prefix.json
	$(PY) benchmarks/request_settings.py benchmarks/results/request_settings.json

bench-quick: $(VENV)/.installed
	$(PY) benchmarks/batching.py benchmarks/results/batching-quick.json --quick
	$(PY) benchmarks/mtp.py benchmarks/results/mtp-quick.json --quick
	$(PY) benchmarks/long_prompts.py benchmarks/results/long_prompts-quick.json --quick
	$(PY) benchmarks/admission.py benchmarks/results/admission-quick.json --quick
	$(PY) benchmarks/structured.py benchmarks/results/structured-quick.json --quick
	$(PY) benchmarks/vision_prefix.py benchmarks/results/vision_prefix-quick.json --quick
	$(PY) benchmarks/request_settings.py benchmarks/results/request_settings-quick.json --quick

clean:
	rm -rf $(VENV) .pytest_cache benchmarks/results
