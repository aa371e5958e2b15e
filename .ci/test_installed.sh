#!/usr/bin/env bash
# Run the test suite against the tpamp *installed* in a venv (e.g. from the sdist by
# .ci/build_ext.sh), with that venv's torch, instead of the working tree's tpamp (whose kernels
# were built for another torch). The tracked files other than tpamp/ (tests/, scripts/, docs/,
# csrc/, ...) are copied to a temporary folder, where tpamp/ is a link to the installed package:
# the tests, the scripts they start (PYTHONPATH=<that folder>) and the docs checks all see the
# installed package and its kernels.
#
# Usage: .ci/test_installed.sh VENV [PYTEST ARGS...]   (default args: -q -p no:cacheprovider)
# The SIMT tests skip there (tpamp._C_simt is built in the tree only; TPAMP_REQUIRE_SIMT unset).

set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(cd "${1:?usage: test_installed.sh VENV [PYTEST ARGS...]}" && pwd)"
shift
PY="$VENV/bin/python"

# the installed package, found from outside the tree
PKG="$(cd / && "$PY" -c 'import os, tpamp; print(os.path.dirname(os.path.abspath(tpamp.__file__)))')"
# (the venv may live inside the tree, as CI's .ci-venv-cuda does: only the tree's own tpamp/ is refused)
case "$PKG" in "$ROOT"/tpamp|"$ROOT"/tpamp/*) echo "test_installed: tpamp resolves to the tree ($PKG), not an install" >&2; exit 1 ;; esac

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(cd "$ROOT" && git ls-files -z | grep -zv '^tpamp/' | xargs -0 cp --parents -t "$WORK")
ln -s "$PKG" "$WORK/tpamp"
echo "== test_installed: torch $("$PY" -c 'import torch; print(torch.__version__)'), tpamp from $PKG, tests in $WORK"
[ "$#" -gt 0 ] || set -- -q -p no:cacheprovider
cd "$WORK"
env -u TPAMP_REQUIRE_SIMT OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m pytest "$@"
