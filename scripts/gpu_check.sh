#!/usr/bin/env bash
# One command that checks tpamp's CUDA code on a GPU machine, in under 6 minutes, and prints a
# short table last (docs/guide/kernels.md, "Checking a GPU machine", says what each row means):
#
#   bash scripts/gpu_check.sh OUTDIR              # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run OUTDIR    # anywhere: CPU stand-ins, small sizes, < 1 min
#
# Steps, in this order, each under its own timeout and all under one budget (GPU_CHECK_BUDGET_S,
# default 345 s; 55 s for --dry-run), so one hang cannot eat the rest; a step with no time left
# is skipped with a line saying so:
#   env        versions, the GPU, the tools found                        (scripts/gpu_check.py env)
#   build      tpamp._C with CUDA kernels for this GPU only (TORCH_CUDA_ARCH_LIST from
#              torch.cuda.get_device_capability()) and this CPU's kernel module, in the tree
#              (setup.py build_ext --inplace), MAX_JOBS = all cores. Dry run: uses the kernels
#              already built in the tree and shows the command it would run.
#   errors     a call each launcher rejects raises RuntimeError (its own process; a crash names
#              the toolchain facts: a module with its own copy of libstdc++ crashes there)
#   cuda_tests pytest -m cuda tests/, in 4 xdist workers when pytest-xdist is there (a crash
#              fails one test, not the step) (dry run: tests/test_kernels_cuda.py, which must skip)
#   compare    every kernel against its CPU twin and a float64 reference on adversarial lists
#   graph      the sync-free step captured in a CUDA graph and replayed, against eager steps
#   bench      CUDA-event medians: grad-stats pass vs copy, one-pass AdamW vs AdamW(fused=True),
#              tpamp's step vs megatron-core's (when its wheel was carried)
#   train_run  scripts/train_gpt.py on one GPU (NCCL, world 1), a short run; its loss
#   memcheck, racecheck   every kernel's comparisons at small sizes (gpu_check.py compare
#              --small) under compute-sanitizer (GPU only)
#   table      the table, from OUTDIR/*.json, OUTDIR/steps.tsv and OUTDIR/train/summary.json
# Full logs: OUTDIR/<step>.log; rows: OUTDIR/<step>.json; the table: OUTDIR/table.json.
# Exit status: 0 when no row failed, 1 otherwise.
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (a larger one also stretches each
# step's timeout in proportion), CUDA_HOME (default /usr/local/cuda).
# megatron-core is optional: wheels in .whl/ are installed into /tmp/gpu_check_site first (the
# device machine has no network; docs/guide/kernels.md says how to carry them).

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

DRY=0
OUT=""
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $a (usage: gpu_check.sh [--dry-run] OUTDIR)" >&2; exit 2 ;;
        *) [ -z "$OUT" ] || { echo "gpu_check.sh: one OUTDIR, got '$OUT' and '$a'" >&2; exit 2; }
           OUT="$a" ;;
    esac
done
[ -n "$OUT" ] || { echo "usage: gpu_check.sh [--dry-run] OUTDIR" >&2; exit 2; }
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/steps.tsv"

PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
[ -d "$CUDA_HOME/bin" ] && export PATH="$PATH:$CUDA_HOME/bin"
DRYFLAG=()
if [ "$DRY" = 1 ]; then
    DEFAULT_BUDGET=55
    BUDGET="${GPU_CHECK_BUDGET_S:-55}"
    DRYFLAG=(--dry-run)
    export CUDA_VISIBLE_DEVICES=""  # CPU stand-ins even where a GPU is present
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    DEFAULT_BUDGET=345
    BUDGET="${GPU_CHECK_BUDGET_S:-345}"
fi
START=$(date +%s)

# megatron-core, when its wheel (and its needs) were carried in .whl/
if [ "$DRY" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .whl/*.whl > "$OUT/wheels.log" 2>&1 \
        && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

record() {  # NAME RC SECONDS NOTE
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/steps.tsv"
    echo "== gpu_check: $1: rc $2, $3 s${4:+ ($4)}"
}

skip() {  # NAME REASON
    record "$1" skip 0 "$2"
}

# step NAME TIMEOUT_S CMD...: runs CMD with its output in OUTDIR/NAME.log, under
# min(TIMEOUT_S, what is left of the budget); a budget above the default stretches every
# TIMEOUT_S in proportion (a slow or busy machine)
step() {
    local name="$1" limit="$2"
    shift 2
    [ "$BUDGET" -gt "$DEFAULT_BUDGET" ] && limit=$(( limit * BUDGET / DEFAULT_BUDGET ))
    local left=$(( BUDGET - ($(date +%s) - START) ))
    LAST_RC=skip
    if [ "$left" -lt 10 ]; then
        skip "$name" "no time left in the ${BUDGET} s budget"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    local t0 rc note=""
    t0=$(date +%s)
    echo "== gpu_check: $name (timeout ${limit} s): $*"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    LAST_RC=$rc
    case "$rc" in
        124|137) note="timed out after ${limit} s" ;;
        0) note="" ;;
        *) note="see $name.log" ;;
    esac
    record "$name" "$rc" "$(( $(date +%s) - t0 ))" "$note"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
    return 0
}

# --- env (dry run: with compare, graph and bench in one Python process, which keeps the dry
# run under a minute on a 2-core CI machine)
[ "$DRY" = 1 ] || step env 60 "$PY" scripts/gpu_check.py env --out "$OUT"

# --- build
GPU=0 NOT_BUILT="" LAST_RC=""
if [ "$DRY" = 1 ]; then
    ARCH="9.0" CAP="<this CPU's capability>"
    BUILD=(env TPAMP_BUILD_EXT=1 TPAMP_BUILD_CUDA=1 "TORCH_CUDA_ARCH_LIST=$ARCH" "MAX_JOBS=$(nproc)"
           "TPAMP_CPU_CAPABILITIES=$CAP" "$PY" setup.py build_ext --inplace)
    # the kernels already built in the tree (env's row says which loaded)
    step build 5 echo "dry run: would run: ${BUILD[*]}"
else
    # this CPU's kernel module, this GPU's architecture (none: no GPU)
    read -r CAP ARCH < <("$PY" -c "
import torch
cap = torch.backends.cpu.get_cpu_capability().lower()
arch = '%d.%d' % torch.cuda.get_device_capability() if torch.cuda.is_available() else 'none'
print(cap, arch)" 2>/dev/null)
    case "$CAP" in avx512|avx2) ;; *) CAP=default ;; esac
    GPU=1
    [ -n "$ARCH" ] && [ "$ARCH" != none ] || { GPU=0; ARCH="9.0"; }
    step build 200 env TPAMP_BUILD_EXT=1 TPAMP_BUILD_CUDA=1 "TORCH_CUDA_ARCH_LIST=$ARCH" \
        "MAX_JOBS=$(nproc)" "TPAMP_CPU_CAPABILITIES=$CAP" "$PY" setup.py build_ext --inplace
    step build_check 30 "$PY" -c "
import torch, tpamp._C as C
from tpamp import _ext, ops
print(_ext.status())
assert C.with_cuda == 1, 'tpamp._C was built without CUDA kernels'
assert ops.extension_available('cuda') and ops.extension_available('cpu'), _ext.status()
"
    # without the kernels the GPU steps would only skip: say so once, per step
    [ "$LAST_RC" = 0 ] || NOT_BUILT="the build did not give tpamp._C with CUDA kernels (build.log, build_check.log)"
    # a rejected call raises (each probe in its own process: a crash there names the toolchain)
    [ -n "$NOT_BUILT" ] || step errors 40 "$PY" scripts/gpu_check.py errors --out "$OUT"
fi

# pytest-xdist runs the tests in worker processes, so a test that crashes its process is one
# failed test ("worker crashed") and the others still run; pytest-timeout bounds each test
PYTEST_EXTRA=()
"$PY" -c "import xdist" 2> /dev/null && PYTEST_EXTRA+=(-n 4)
"$PY" -c "import pytest_timeout" 2> /dev/null && PYTEST_EXTRA+=(--timeout 90)

# --- the CUDA tests
if [ -n "$NOT_BUILT" ]; then
    skip cuda_tests "$NOT_BUILT"
elif [ "$DRY" = 1 ]; then
    step cuda_tests 40 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs tests/test_kernels_cuda.py
else
    step cuda_tests 120 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs "${PYTEST_EXTRA[@]}" tests/
fi

# --- kernels vs CPU twins vs float64, graph replay, timings
if [ "$DRY" = 1 ]; then
    step parts 40 "$PY" scripts/gpu_check.py env errors compare graph bench --out "$OUT" --dry-run
else
    step compare 90 "$PY" scripts/gpu_check.py compare --out "$OUT"
    step graph 45 "$PY" scripts/gpu_check.py graph --out "$OUT"
    step bench 90 "$PY" scripts/gpu_check.py bench --out "$OUT"
fi

# --- the main job, one rank (NCCL on a GPU; gloo on CPU in the dry run)
rm -rf "$OUT/train"
if [ "$DRY" = 1 ]; then
    SIZE=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
          --micro-batch-size 2 --num-microbatches 2 --train-iters 6 --lr 1e-2 --lr-warmup-iters 1
          --log-interval 2 --eval-interval 6 --eval-iters 1 --data-max-bytes 200000)
else
    SIZE=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 256
          --micro-batch-size 8 --num-microbatches 2 --train-iters 60 --lr 2e-3 --lr-warmup-iters 5
          --log-interval 10 --eval-interval 60 --eval-iters 2)
fi
if [ "$DRY" = 0 ] && [ "$GPU" = 0 ]; then
    skip train_run "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
else
# world 1: the environment torchrun would set, without its agent process
step train_run 90 env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$(( 20000 + RANDOM % 20000 )) "$PY" scripts/train_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "${SIZE[@]}" \
    --no-progress --dist-timeout 60 --log-dir "$OUT/train"
fi

# --- every kernel under compute-sanitizer: the comparisons at the dry run's sizes (compare
# --small; the pytest file took > 75 s under memcheck at its sizes, and the > 2^31-element case
# would take hours), rows in OUTDIR/<tool>/
SAN="$(command -v compute-sanitizer || true)"
[ -n "$SAN" ] || { [ -x "$CUDA_HOME/bin/compute-sanitizer" ] && SAN="$CUDA_HOME/bin/compute-sanitizer"; }
for tool in memcheck racecheck; do
    if [ "$DRY" = 1 ]; then
        skip "$tool" "dry run: compute-sanitizer needs a GPU (on CPU, tests/test_simt_tsan.py runs the launchers under ThreadSanitizer)"
    elif [ -n "$NOT_BUILT" ]; then
        skip "$tool" "$NOT_BUILT"
    elif [ -z "$SAN" ]; then
        skip "$tool" "compute-sanitizer not found on PATH or in $CUDA_HOME/bin"
    else
        step "$tool" 60 "$SAN" --tool "$tool" --error-exitcode 97 --target-processes all \
            "$PY" scripts/gpu_check.py compare --small --out "$OUT/$tool"
    fi
done

record total 0 "$(( $(date +%s) - START ))" "budget ${BUDGET} s"
"$PY" scripts/gpu_check.py table --out "$OUT" "${DRYFLAG[@]}"
