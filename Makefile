# The README's two set-up commands: `make demo` (install + the main job on its embedded default)
# and `make test` (install + the test suite). `.ci/run` calls `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: venv demo test
venv:
	bash .ci/install-venv.sh $(VENV)

demo: venv
	$(VENV)/bin/locks eval microscope

# TRITON_INTERPRET=1 runs the Triton kernels on the CPU (no GPU here or in CI).
test: venv
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)
