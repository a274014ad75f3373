# Two entry points on a fresh machine: `make up` and `make test` (both set up .venv first).
PY := .venv/bin/python

.PHONY: setup up run test lint bench helm-check

setup:
	bash .ci/setup

up: setup
	.venv/bin/tandem up

run: setup
	.venv/bin/tandem generate --chat "What is paged attention in one paragraph?"

lint:
	.venv/bin/ruff check .

test: setup lint
	.venv/bin/pytest -q --durations=25

bench: setup
	$(PY) -m loadtest.engine_bench

# The Helm chart and Dockerfile checks alone (real helm, Kubernetes and KubeRay schemas, hadolint).
helm-check: setup
	.venv/bin/pytest -q tests/deploy
