# `make train` runs the default job, `make test` the test suite, `make sabotage` the sabotage checks;
# each sets up .venv first.
PY ?= python3
# torch and torchvision must be a matching pair (a mismatched torchvision fails to import)
TORCH ?= torch==2.14.1 torchvision==0.29.1
# pip options for torch and torchvision alone, e.g. TORCH_PIP="--index-url https://download.pytorch.org/whl/cpu"
# (PyTorch's CPU builds: no CUDA libraries in .venv); empty: the registry's default build
TORCH_PIP ?=
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test test-docs test-all matrix matrix-subset sabotage lint bench clean gpu-wheels

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH_PIP) $(TORCH)
	$(VENV)/bin/pip install -q -e ".[dev,hf,finetune]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python train.py $(ARGS)

# the default suite on one pytest worker per two cores (tests/conftest.py), a test file per worker
# at a time, the longest files first; `make test TEST_WORKERS=0` runs it in this one process
# Our own modules are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (CI images), every
# train.py, launcher and forkserver the tests start would compile them again from source
COMPILE := $(VENV)/bin/python -m compileall -q framework models train.py > /dev/null
TEST_WORKERS ?= auto
test: $(STAMP)
	$(COMPILE)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# every doc's quick start whole, as written (tests/test_docs.py's long tier: the runs the default
# suite composes instead); CI runs it after `make test`
test-docs: $(STAMP)
	$(VENV)/bin/python -m pytest -m slow tests/test_docs.py $(ARGS)

# the default suite and the long tier (-m slow: the cases the default run keeps one of), on the
# same workers; not the full matrix
test-all: $(STAMP)
	$(COMPILE)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not matrix" $(ARGS)

# every model and feature under every strategy: parity or a one-line refusal; writes docs/results/matrix.md
matrix: $(STAMP)
	$(COMPILE)
	HYDRADIST_RESULTS_DIR=docs/results $(VENV)/bin/python -m pytest tests/test_matrix.py -m matrix $(ARGS)

# the covering subset of the matrix (every pair of a model, a strategy family and a feature meets;
# `make test` runs its one- and two-process cells), alone, on this CPU's kernels and another family's, its tables written to
# docs/results/matrix-subset/ (matrix.md, matrix_wide.md, matrix_kernels.md)
matrix-subset: $(STAMP)
	HYDRADIST_RESULTS_DIR=docs/results/matrix-subset $(VENV)/bin/python -m pytest -n 2 --dist loadfile -m "not matrix" \
		tests/test_matrix.py tests/test_matrix_wide.py tests/test_matrix_kernels.py -k covering_subset $(ARGS)

# each one-line sabotage of tests/sabotage.py in a temporary copy, and the test that catches it
sabotage: $(STAMP)
	$(VENV)/bin/python tests/sabotage.py $(ARGS)

bench: $(STAMP)
	cd benchmarks && for b in memory comm data checkpoint plan; do ../$(VENV)/bin/python $$b.py; done

# what the lent GPU machine's python lacks (docs/gpu.md), as wheels for its Python 3.12, into .whl/
# (ignored; carried with the tree): the versions this .venv runs. antlr4's 4.9.3 is published as a
# source archive only: built here into a wheel of pure Python.
# torchao (converters=[float8], gpu.sh's float8 rows) is carried where this .venv has it: a cp310-abi3
# wheel (~3.4 MB) whose C++ kernels are built for torch 2.11, the lent machine's; float8 training is
# Python over torch._scaled_mm. Without it the float8 rows say so and skip.
GPU_WHEELS := hydra-core omegaconf
GPU_PLATFORM := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(VENV)/bin/pip download -q --no-deps --only-binary=:all: $(GPU_PLATFORM) -d .whl \
		$(foreach p,$(GPU_WHEELS),$(p)==$$($(VENV)/bin/python -c "import importlib.metadata as m; print(m.version('$(p)'))"))
	$(VENV)/bin/pip wheel -q --no-deps -w .whl \
		antlr4-python3-runtime==$$($(VENV)/bin/python -c "import importlib.metadata as m; print(m.version('antlr4-python3-runtime'))")
	@v=$$($(VENV)/bin/python -c "import importlib.metadata as m; print(m.version('torchao'))" 2>/dev/null); \
	if [ -n "$$v" ]; then $(VENV)/bin/pip download -q --no-deps --only-binary=:all: $(GPU_PLATFORM) -d .whl torchao==$$v; \
	else echo "torchao: not in $(VENV); not carried (gpu.sh's float8 rows skip)"; fi
	@ls -l .whl && du -sh .whl

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs multirun .pytest_cache
