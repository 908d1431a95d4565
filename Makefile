# The two commands of the README:  `make demo`  and  `make test`.
# Both create the virtual environment .venv on first use and install trainer_nb with its development tools.

PYTHON ?= python3
VENV ?= .venv
# the PyTorch build to install (a CPU or a CUDA wheel, whatever pip finds for this pin)
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-quick test-nbs test-py install readme docs clean

demo: $(VENV)/.installed
	$(BIN)/trainer-nb demo

test: test-nbs test-py

# every notebook of nbs/ runs, each in a fresh Jupyter kernel as a reader runs it (two at a time; the cells flagged
# `notest` or `slow` are skipped, as nbdev_test skips them); a notebook that fails fails the tests. The runs are kept
# in _exec/, where the docs build of test-py takes them instead of running every notebook a second time. Each kernel
# gets its share of the cores for PyTorch's threads (OMP_NUM_THREADS, unless set): two full teams on 2 cores spin
# against each other (tools/build_docs.py)
test-nbs: $(VENV)/.installed
	$(BIN)/python tools/build_docs.py --run-only

# pytest-xdist: WORKERS processes share out the test files (a file's tests in one process: its module fixtures made
# once, the docs build among them), the longest files first (tests/conftest.py's FIRST; xdist's own order, the files
# with most tests first, is turned off); then the tests marked `serial` run alone: a test that loads the machine itself
# (see tests/conftest.py); each worker, and what it starts, takes its share of the cores for PyTorch's threads
WORKERS ?= 2
# the files that hold tests marked `serial` (collecting every file again would take 15-20 s)
SERIAL_FILES = $(shell grep -l 'pytest.mark.serial' tests/test_*.py)
PYTEST_FLAGS ?= -q -p no:cacheprovider --durations=20

test-py: $(VENV)/.installed
	$(BIN)/pytest $(PYTEST_FLAGS) -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m 'not serial' tests
	$(BIN)/pytest $(PYTEST_FLAGS) -m serial $(SERIAL_FILES)

# between commits (a few minutes): the loop, hooks, resume and checkpoints, the recorded numbers, export sync and
# code quality; tests marked `slow` (a minute or more each) are left to `make test`
QUICK = test_loop test_short_path test_recorder test_schedule test_accum test_checkpoint test_resume_loud test_stop \
        test_best_weights test_eval test_seed test_ema test_plateau test_sync test_code_quality
test-quick: $(VENV)/.installed
	$(BIN)/pytest $(PYTEST_FLAGS) -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m 'not serial and not slow' \
		$(foreach t,$(QUICK),$(wildcard tests/$(t).py))

install: $(VENV)/.installed

$(VENV)/.installed: settings.ini setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# README.md is generated from nbs/index.ipynb (after running it: outputs are part of the README)
readme: $(VENV)/.installed
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.store_widget_state=False nbs/index.ipynb
	$(BIN)/nbdev_clean --fname nbs/index.ipynb
	$(BIN)/python tools/render_readme.py

# the docs site, from the notebooks, into _docs/ (open _docs/index.html)
docs: $(VENV)/.installed
	$(BIN)/python tools/build_docs.py

clean:
	rm -rf $(VENV) _proc _docs build *.egg-info
