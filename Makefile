# weight-checker: the two commands are `make demo` (the main job) and
# `make test` (everything CI runs); `make check` is the developers' fast loop.
# Every target that runs a tool from .venv depends on `env` (or `env-main`),
# which sets it up (idempotent), so each works from a fresh clone.

PY := .venv/bin/python

.PHONY: env env-main test check test-rust test-python lint lint-quick wheel bench demo clean

env:
	scripts/dev-env.sh

## .venv only (no vLLM 0.31 or SGLang environment): what the demo needs.
env-main:
	WEIGHT_CHECKER_NO_VLLM031=1 WEIGHT_CHECKER_NO_SGLANG=1 scripts/dev-env.sh

## Everything CI runs: lint, Rust tests, the wheel, the Python suite (real vLLM
## servers and engines included, every kernel checked against hashlib).
test: env lint test-rust wheel test-python

## The fast inner loop: lint, the Rust tests, and the Python tests that need no
## vLLM server or engine (pytest -m "not vllm"). Not what CI runs: make test is.
check: env lint test-rust
	$(PY) -m pytest -q -m "not vllm" --durations=15

## stubtest: the stub against the compiled module (scripts/stubtest-mypy.ini says
## why it analyses no other module).
lint: lint-quick
	.venv/bin/python -m mypy.stubtest --mypy-config-file scripts/stubtest-mypy.ini weight_checker._core

lint-quick: env
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python -- -D warnings
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m mypy

## A release build: the abi3 manylinux wheel (maturin's compliance check on)
## and the sdist, into dist/. Installs without Rust (tests/test_wheel.py).
wheel: env
	rm -rf dist
	.venv/bin/maturin build --release --auditwheel check -o dist
	.venv/bin/maturin sdist -o dist

test-rust:
	cargo test --profile test-release

# The whole suite in one run, the 15 slowest tests and the vLLM servers it
# started listed at the end. Every kernel (the calibrated choice, the portable
# fallback, SHA-NI lanes fixed, the 16-lane AVX-512 kernel) is checked against
# hashlib inside it (tests/test_kernels.py).
test-python: env
	$(PY) -m pytest --durations=15

bench: env
	$(PY) benches/bench_checksum.py

## The main job: a real vLLM with our plugin, checked by `weight-checker verify`.
## make demo TRANSFER="--transfer-cmd true" shows a transfer that did nothing.
TRANSFER ?=
demo: env-main
	$(PY) scripts/demo.py "$(TRANSFER)"

clean:
	rm -rf target .venv
