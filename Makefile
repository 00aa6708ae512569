# weight-checker: the two commands are `make demo` (the main job) and
# `make test` (everything CI runs). Every target that runs a tool from .venv
# depends on `env`, which sets it up (idempotent), so each works from a fresh clone.

PY := .venv/bin/python

.PHONY: env test test-rust test-python lint wheel bench demo clean

env:
	scripts/dev-env.sh

## Everything CI runs: lint, Rust tests, the wheel, the Python suite with both kernels.
test: env lint test-rust wheel test-python

lint: env
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python -- -D warnings
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m mypy.stubtest weight_checker._core
	.venv/bin/python -m mypy

## A release build: the abi3 manylinux wheel (maturin's compliance check on)
## and the sdist, into dist/. Installs without Rust (tests/test_wheel.py).
wheel: env
	rm -rf dist
	.venv/bin/maturin build --release --auditwheel check -o dist
	.venv/bin/maturin sdist -o dist

test-rust:
	cargo test --release

# The whole suite with the calibrated kernels, then the digest suites again
# with the portable fallback forced, with the SHA-NI lanes fixed (no 16-lane
# AVX-512 at all) and with the 16-lane AVX-512 kernel asked for (streamed
# and small tensors alike), so every kernel is checked against hashlib
# whichever the calibration picks on this CPU.
DIGEST_SUITES := tests/test_digests.py tests/test_core.py tests/test_walk.py
test-python: env
	$(PY) -m pytest
	WEIGHT_CHECKER_KERNEL=portable $(PY) -m pytest -q $(DIGEST_SUITES)
	WEIGHT_CHECKER_LANES=4 $(PY) -m pytest -q $(DIGEST_SUITES)
	WEIGHT_CHECKER_LANES=16 $(PY) -m pytest -q $(DIGEST_SUITES)

bench: env
	$(PY) benches/bench_checksum.py

## The main job: a real vLLM with our plugin, checked by `weight-checker verify`.
## make demo TRANSFER="--transfer-cmd true" shows a transfer that did nothing.
TRANSFER ?=
demo: env
	$(PY) scripts/demo.py "$(TRANSFER)"

clean:
	rm -rf target .venv
