# The two entry points named at the top of README.md. Both bootstrap .venv.
PY := .venv/bin/python
ENV := . scripts/env.sh &&

.PHONY: bootstrap hub hub-compat test bench

bootstrap:
	bash scripts/bootstrap.sh

hub: bootstrap
	$(ENV) $(PY) build/hub.py all --out dist/hub

# The same job, loading with the older pair users still pin (requirements-compat.lock,
# .venv-compat); tests/test_compat.py runs it with fewer load methods.
hub-compat: bootstrap
	bash scripts/bootstrap_compat.sh
	$(ENV) $(PY) build/hub.py all --out dist/hub-compat --python .venv-compat/bin/python

# Two workers (the CI host has two cores), one test file per worker at a time: a file's
# module fixtures (Hub builds, saved models) are built once.
test: bootstrap
	$(ENV) $(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

# Measured tables beyond tokamax's wheel (v5p, v6e, the larger tpu7x one): a folder in tokamax's
# repository layout at commit 783ea95 (make bench CALIBRATION_DATA=DIR); unset: the wheel's tables only.
CALIBRATION_DATA ?=

bench:
	bash scripts/bootstrap.sh bench
	$(ENV) $(PY) bench/bench_ragged_dot.py
	$(ENV) $(PY) bench/bench_experts.py
	$(ENV) $(PY) bench/bench_attention.py
	$(ENV) $(PY) bench/bench_attention_tpu.py --generations v5e v6e tpu7x
	$(ENV) $(PY) bench/calibrate_tpu_estimator.py $(if $(CALIBRATION_DATA),--data $(CALIBRATION_DATA)) --max-entries 8 \
		--out bench/results/tpu_calibration_bounded.md
	$(ENV) $(PY) bench/bench_tpu_estimates.py --chips v5e v6e tpu7x --sweep-rounds 0
	$(ENV) $(PY) bench/bench_expert_parallel.py
