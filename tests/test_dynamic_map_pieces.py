"""The AVX2 uint8 encode's piece tables (csrc/cpu/dynamic_map_pieces.h) are the ones
scripts/gen_dynamic_map.py --pieces generates (and checks) from the map of
tpamp.state_formats.dynamic_map; the codes the AVX2 module computes from them are checked by
tests/test_dynamic_map_modules.py and scripts/check_dynamic_map_exhaustive.cpp."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_piece_tables_are_generated():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_dynamic_map.py"),
                          "--pieces"], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    with open(os.path.join(ROOT, "csrc", "cpu", "dynamic_map_pieces.h")) as f:
        committed = f.read()
    assert out == committed, "re-run scripts/gen_dynamic_map.py --pieces"
