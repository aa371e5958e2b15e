#!/usr/bin/env bash
# Build the kernels with CUDA (tpamp._C) in a virtual environment and check that the ops register
# for CUDA and CPU. Only the default CPU capability module is built unless TPAMP_CPU_CAPABILITIES
# names more (.ci/run names all three: the CPU suite then runs against this install).
# Needs no GPU: only nvcc of the same CUDA major version as the torch wheel.
#
# Usage: .ci/build_ext.sh [VENV_DIR]
#   VENV_DIR               the venv to create or reuse (default: <repo>/.ci-venv-cuda)
# Environment (all optional):
#   PYTHON                 interpreter that creates the venv (default python3)
#   TPAMP_CI_TORCH         torch requirement (default torch==2.11.0, the oldest tpamp supports,
#                          from the default index: its CUDA 13.0 build, as the GPU machines have)
#   TPAMP_CI_PIP_ARGS      extra pip arguments for that install (e.g. an --index-url)
#   CUDA_HOME              CUDA toolkit (default /usr/local/cuda)
#   TORCH_CUDA_ARCH_LIST   GPU architectures (default "8.0;9.0+PTX": quick; setup.py alone adds 10.0, 12.0)
#   MAX_JOBS               parallel compile jobs (default 2; each needs up to ~2 GB of memory)
#   TPAMP_CI_SDIST         an sdist (.tar.gz) to install instead of the working tree (-e .); the
#                          checks then import the installed tpamp from outside the tree
# Exits non-zero on any failure, saying which step failed.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.ci-venv-cuda}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
PYTHON="${PYTHON:-python3}"
TORCH_REQ="${TPAMP_CI_TORCH:-torch==2.11.0}"
read -r -a PIP_ARGS <<< "${TPAMP_CI_PIP_ARGS:-}"

step() { echo "== build_ext: $*"; }
fail() { echo "build_ext: FAILED: $*" >&2; exit 1; }

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}"
export MAX_JOBS="${MAX_JOBS:-2}"
[ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"

if [ -x "$VENV/bin/python" ]; then
    step "reusing the venv $VENV"
else
    step "creating the venv $VENV"
    "$PYTHON" -m venv "$VENV" || fail "could not create the venv $VENV with $PYTHON"
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"  # the venv's ninja, which torch's BuildExtension looks up on PATH

# setuptools >= 77 as pyproject.toml's [build-system] asks (a Python 3.11 venv starts with 65.5,
# too old for its license field; torch 2.11 caps it below 82)
step "installing $TORCH_REQ numpy setuptools>=77 wheel ninja"
"$PY" -m pip install ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "$TORCH_REQ" numpy "setuptools>=77" wheel ninja \
    || fail "pip install of the build requirements"

if [ -n "${TPAMP_CI_SDIST:-}" ]; then
    SRC="$(cd "$(dirname "$TPAMP_CI_SDIST")" && pwd)/$(basename "$TPAMP_CI_SDIST")"
    INSTALL=("$SRC")
    CHECK_DIR="$(mktemp -d)"  # outside the tree: import the installed tpamp
else
    INSTALL=(-e .)
    CHECK_DIR="$ROOT"
fi
step "building tpamp._C from ${INSTALL[*]} (CUDA_HOME=$CUDA_HOME, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
start=$(date +%s)
(cd "$ROOT" && TPAMP_BUILD_CUDA=1 TPAMP_CPU_CAPABILITIES="${TPAMP_CPU_CAPABILITIES:-default}" "$PY" -m pip install -v --no-build-isolation --no-deps "${INSTALL[@]}") \
    || fail "building the extension (see the compiler output above)"
step "built in $(( $(date +%s) - start )) s"

step "checking that torch.ops.tpamp.* are registered (from $CHECK_DIR)"
(cd "$CHECK_DIR" && "$PY" - <<'EOF') || fail "the extension does not load or lacks an op"
import torch

import tpamp
import tpamp._C  # noqa: F401  (registers torch.ops.tpamp.*)
from tpamp import ops

from tpamp import _ext

assert ops.extension_available(), _ext.status()  # loads tpamp._C and a CPU module
names = [n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("tpamp::")]
assert len(names) >= 7, names
for name in names:
    op = getattr(torch.ops.tpamp, name).default
    print(op._schema)
    for key in ("CUDA", "CPU", "Autograd", "ADInplaceOrView"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)
assert tpamp._C.with_cuda == 1, "tpamp._C was built without the CUDA kernels"
print(f"tpamp {tpamp.__version__} from {tpamp.__file__}: tpamp._C loads with torch {torch.__version__} "
      f"(CUDA {torch.version.cuda})")
EOF
step "OK"
