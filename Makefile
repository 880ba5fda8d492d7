# The README's two set-up commands: `make demo` (install + the main job on its embedded default)
# and `make test` (install + the test suite). `.ci/run` calls `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: stamp venv demo test wheel tree candidate
venv:
	bash .ci/install-venv.sh $(VENV)

demo: venv
	$(VENV)/bin/locks eval microscope

# TRITON_INTERPRET=1 runs the Triton kernels on the CPU (no GPU here or in CI). TEST_WORKERS pytest-xdist
# workers (one per core of the CI machine); the engine tests share one of them (tests/conftest.py).
TEST_WORKERS ?= 2
test: venv
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# A wheel for machines without the checkout (the H200): it carries the commit in build_info.json so
# records made there still name the code that made them.
wheel: venv stamp
	rm -rf .gpu/wheel build
	$(VENV)/bin/python -m pip wheel -q --no-deps -w .gpu/wheel .
	rm -f harness/build_info.json

# The same stamp alone, for GPU runs that import the checkout itself (carry harness/build_info.json;
# the device copy's .git may be older than its files). Delete it afterwards: it wins over git.
# STAMP REF FILE dirty|clean: the commit REF names into FILE, with (dirty) whether the tracked files differ from it.
STAMP = $(VENV)/bin/python -c "import json, subprocess as s, sys; ref, path, mode = sys.argv[1:]; c = s.run(['git', 'rev-parse', ref], capture_output=True, text=True).stdout.strip(); d = mode == 'dirty' and bool(s.run(['git', 'status', '--porcelain', '--untracked-files=no'], capture_output=True, text=True).stdout.strip()); json.dump({'commit': c, 'dirty': d}, open(path, 'w'))"
stamp:
	$(STAMP) HEAD harness/build_info.json dirty

# Another commit's package folders with their own stamp, for a kernel A/B call that carries them beside the
# checkout (docs/lease/select-ab.sh): `make tree REF=select-histogram DEST=.gpu/new`.
REF ?= HEAD
DEST ?= .gpu/tree
tree:
	rm -rf $(DEST) && mkdir -p $(DEST)
	git archive $(REF) kernels harness suites reports locks_cli | tar -x -C $(DEST)
	$(STAMP) $(REF) $(DEST)/harness/build_info.json clean

# A tree of HEAD with a prepared candidate patch applied (docs/lease/candidates/), for the same A/B call; its stamp
# names HEAD as dirty: `make candidate PATCH=docs/lease/candidates/score-scale-order.patch DEST=.gpu/cand`.
PATCH ?=
candidate:
	@test -f "$(PATCH)" || { echo "make candidate needs PATCH=docs/lease/candidates/<name>.patch (an existing file; got '$(PATCH)')"; exit 2; }
	$(MAKE) --no-print-directory tree REF=HEAD DEST=$(DEST)
	git apply --directory=$(DEST) --include='$(DEST)/kernels/*' --include='$(DEST)/harness/*' $(PATCH)
	$(VENV)/bin/python -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['dirty'] = True; json.dump(d, open(p, 'w'))" $(DEST)/harness/build_info.json
