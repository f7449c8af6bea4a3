# The README's commands. `make quickstart` runs the main job offline; `make test` runs the suite.
PYTHON ?= python3
PILOT_COMMIT ?= 5240714

.PHONY: install quickstart test demo smoke-matrix bench exps

install:
	$(PYTHON) -m pip install -q -e ".[pilot,test,plots,ray,tensorboard,safetensors]"

quickstart:
	bash scripts/quickstart.sh

# Without PILOT_ROOT the PILOT tests are skipped; .ci/run sets it and requires them.
test: install
	@if [ -z "$$PILOT_ROOT" ]; then echo "make test: PILOT_ROOT is not set, so the PILOT tests \
	will be skipped; to run them too: PILOT_ROOT=../shared/LAMDA-PILOT make test \
	(or any LAMDA-PILOT checkout at commit $(PILOT_COMMIT))"; fi
	$(PYTHON) -m pytest -q -rs tests

demo: install
	pilot-online demo

smoke-matrix: install
	$(PYTHON) scripts/smoke_matrix.py

bench: install
	$(PYTHON) benchmarks/bench_fgh.py
	$(PYTHON) benchmarks/bench_prototypes.py

exps:
	$(PYTHON) scripts/make_exps.py
