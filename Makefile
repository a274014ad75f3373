# Two entry points on a fresh machine: `make up` and `make test` (both set up .venv first;
# only the tests' set-up needs root, for the servers they start).
PY := .venv/bin/python

.PHONY: setup test-setup up run test lint bench helm-check gpu-check multihost

setup:
	bash .ci/setup

test-setup: setup
	bash .ci/setup-test

up: setup
	.venv/bin/tandem up

run: setup
	.venv/bin/tandem generate --chat "What is paged attention in one paragraph?"

lint: test-setup
	.venv/bin/ruff check .

# Two pytest workers, one per core: a test file runs whole on one worker; the files that start
# Ray clusters run on one worker one after another (tests/conftest.py).
test: test-setup lint
	.venv/bin/pytest -q -n 2 --durations=25

bench: setup
	$(PY) -m tandem.loadtest.engine_bench

# The Helm chart and Dockerfile checks alone (real helm, Kubernetes and KubeRay schemas, hadolint).
helm-check: test-setup
	.venv/bin/pytest -q tests/deploy

# Tandem across three hosts made of network namespaces on this machine (root): exactness over
# TCP and NIXL (across the link and over loopback, with the transfer figures), a faulty link, a
# partition; a JSON summary as the last line (docs/operations.md).
multihost: test-setup
	$(PY) -m tests.e2e.multihost

# The engine's GPU path on one NVIDIA GPU with torch and Triton installed (nothing else; not
# part of `make test`): numerics against the torch reference, then decode and prefill timings
# against the HBM floor and SDPA, one JSON line per check in $(OUT) (docs/operations.md).
OUT ?= results/gpu_check
gpu-check:
	python3 -m tandem.loadtest.gpu_check --sections kernels sampler sweep recompiles decode prefill agreement --out $(OUT)
