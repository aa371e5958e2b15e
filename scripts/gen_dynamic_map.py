"""Prints the tables of the uint8 (dynamic map) moment format for csrc/kernels/optimizer_step.h.

Usage: PYTHONPATH=. python scripts/gen_dynamic_map.py > csrc/kernels/dynamic_map_tables.h
(included by csrc/kernels/optimizer_step.h, which defines TPAMP_TABLE and the constants), and
PYTHONPATH=. python scripts/gen_dynamic_map.py --python > tpamp/_dynamic_map_table.py (the maps
of tpamp.state_formats.dynamic_map, from tpamp.state_formats.create_dynamic_map: run it at the
AVX-512 capability, where the committed tables were made; torch's float32 linspace rounds
differently at others), and PYTHONPATH=. python scripts/gen_dynamic_map.py --pieces >
csrc/cpu/dynamic_map_pieces.h (the AVX2 encode's decade pieces, see piece_tables).

Tables (docs/spec.md section 9):
* kDynamicMapSigned / kDynamicMapUnsigned: the 256 values of tpamp.state_formats.dynamic_map
  (signed / unsigned) plus 2.0 at index 256 (read, never chosen: the search clamps to 255).
* kDynamicFloorSigned / kDynamicFloorUnsigned: for every segment of float32 bit patterns, the
  code the search starts from. A segment is one sign, one exponent in [-22, 0] and the top
  kDynamicSegmentBits mantissa bits (slot 0: |y| < 2^-22; the last slot: |y| >= 1, inf, NaN);
  the entry is the largest code c with map[c] <= the segment's lowest value (0 when none).
  Every segment holds at most one map entry above its lowest value (checked here), so one
  step (c += y >= map[c + 1]) finds the largest c with map[c] <= y.
* kDynamicThresholdSigned / kDynamicThresholdUnsigned: for c = 0..254, the smallest float32 y
  whose code is above c (T[c]; index 255 holds FLT_MAX, never read by the search). The code rule
  is monotone in y, so code(y) = #{c <= 254 : T[c] <= y} for every float32 y but NaN (float
  comparisons: -0.0 counts as 0.0); the tests and the exhaustive check
  (scripts/check_dynamic_map_exhaustive.cpp) compare the kernels' codes with it. Each T[c] is
  found by bisection over the float32 bit patterns with the rule below and checked: code(T[c])
  > c and code(the float32 below T[c]) <= c. (tests/test_dynamic_map.py checks every threshold
  and its neighbours through the kernels of every CPU module against the numpy rule.)
* kDynamicKeyedSigned / kDynamicKeyedUnsigned: segments as the floor tables' but from 2^-24
  (KEY_E_LO; no threshold below it), one 32-bit entry each: the code of the segment's lowest
  value and the low 16 bits of the one threshold inside (see key_table), for the AVX2 and the
  scalar encode of the CPU launcher (one read per element).
"""

import re
import struct
import sys

import numpy as np

from tpamp.state_formats import create_dynamic_map, dynamic_map

SEG_BITS = 7
E_LO = -22
SLOTS = 22 * (1 << SEG_BITS) + 3  # per sign: tiny, [2^-22, 1) in segments, [1, inf] and NaN


def f32(x):
    return float(np.float32(x))


def next_down(x):
    """The largest float32 below the float32 x > 0."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", b - 1))[0]


def floor_code(q, y):
    c = int(np.searchsorted(q, np.float32(y), side="right")) - 1
    return max(c, 0)


def segments(e_lo=E_LO):
    """(low, high, closed_high) of every segment of float32 y, in table order (sign, slot);
    slots per sign: |y| < 2^e_lo, -e_lo binades of 2^SEG_BITS segments, [1, inf] and NaN, one
    unused."""
    slots = -e_lo * (1 << SEG_BITS) + 3
    for sign in (1.0, -1.0):
        for slot in range(slots):
            if slot == 0:
                lo_mag, hi_mag = 0.0, 2.0 ** e_lo
            elif slot == slots - 1:
                lo_mag, hi_mag = 1.0, float("inf")
            else:
                t = slot - 1
                e, m = divmod(t, 1 << SEG_BITS)
                lo_mag = 2.0 ** (e_lo + e) * (1 + m / (1 << SEG_BITS))
                hi_mag = 2.0 ** (e_lo + e) * (1 + (m + 1) / (1 << SEG_BITS))
            if sign > 0:
                yield lo_mag, hi_mag, False  # [low, high)
            else:
                low = -next_down(hi_mag) if hi_mag != float("inf") else -float("inf")
                yield low, -lo_mag, True  # [low, high]


def table(q):
    q = np.asarray(q, dtype=np.float32)
    out = []
    for low, high, closed in segments():
        c = floor_code(q, low)
        inside = [v for v in q if low < v <= high] if closed else [v for v in q if low < v < high]
        assert len(inside) <= 1, (low, high, inside)
        out.append(c)
    return out


KEY_E_LO = -24  # the keyed table's tiny segment |y| < 2^-24 holds no threshold of either map


def key_table(q, ts):
    """For the segments of KEY_E_LO (outside the tiny and the last segment, every float32 of a
    segment shares sign, exponent and 7 mantissa bits, so the low 16 bits order it): code of
    the segment's lowest value | (key of the threshold inside, or 0x10000 for none) << 8, where
    key(y) = low 16 bits of y, complemented for negative y (increasing in y within a segment).
    code(y) = code + (key(y) >= key): one 32-bit read per element."""
    qq = np.asarray(list(q) + [2.0], dtype=np.float32)
    slots = -KEY_E_LO * (1 << SEG_BITS) + 3
    out = []
    for i, (low, high, closed) in enumerate(segments(KEY_E_LO)):
        slot = i % slots
        c = code_rule(qq, low)
        inside = [t for t in ts[:255] if low < t <= high] if closed else [
            t for t in ts[:255] if low < t < high]
        assert len(inside) <= 1, (low, high, inside)
        key = 0x10000
        if inside:
            assert slot not in (0, slots - 2, slots - 1), (slot, inside)
            b = struct.unpack("<I", struct.pack("<f", inside[0]))[0]
            key = (b & 0xFFFF) ^ (0xFFFF if b >> 31 else 0)
        out.append(c | key << 8)
    return out


def code_rule(q, y):
    """The uint8 code of the float32 y (not NaN) in the map q (257 float32 values with 2.0 at
    256): the largest c with q[c] <= y (0 when none), plus one when y - q[c] >= (q[c+1] -
    q[c]) * 0.5 in float32, at most 255 (the rule of optimizer_step.h, torchao's)."""
    y = np.float32(y)
    c = max(int(np.searchsorted(q[:256], y, side="right")) - 1, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        up = np.float32(y - q[c]) >= np.float32(np.float32(q[c + 1] - q[c]) * np.float32(0.5))
    return min(c + int(up), 255)


def ordered(y):
    """float32 y -> an integer that orders as the float does (-0.0 just below +0.0)."""
    b = struct.unpack("<I", struct.pack("<f", y))[0]
    return (b ^ 0x7FFFFFFF) - (1 << 32) if b >> 31 else b


def from_ordered(k):
    b = (k + (1 << 32)) ^ 0x7FFFFFFF if k < 0 else k
    return struct.unpack("<f", struct.pack("<I", b))[0]


def thresholds(q):
    """T[c], c = 0..254: the smallest float32 y with code_rule(q, y) > c; T[255] = FLT_MAX."""
    q = np.asarray(list(q) + [2.0], dtype=np.float32)
    lo_key, hi_key = ordered(-float("inf")), ordered(float("inf"))
    out = []
    for c in range(255):
        lo, hi = lo_key, hi_key  # code(lo) <= c < code(hi)
        assert code_rule(q, from_ordered(lo)) <= c < code_rule(q, from_ordered(hi))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if code_rule(q, from_ordered(mid)) > c:
                hi = mid
            else:
                lo = mid
        t = from_ordered(hi)
        assert code_rule(q, t) > c and code_rule(q, from_ordered(hi - 1)) <= c, c
        out.append(t)
    assert all(a < b for a, b in zip(out, out[1:]))
    # a property of the tables kept checked (no kernel relies on it since the AVX-512 encode
    # uses the decade pieces): every threshold has its own high 16 key bits, and none is +-0
    highs = [ordered(t) >> 16 for t in out]
    assert all(a < b for a, b in zip(highs, highs[1:])), "two thresholds share a high key half"
    assert all(t != 0.0 for t in out)
    return out + [float(np.finfo(np.float32).max)]


def c_floats(vals):
    return ", ".join(re.sub(r"\.?0*p", "p", float(v).hex()) + "f" for v in vals)


def main():
    print("// The tables of the uint8 (dynamic map) moment format: generated by")
    print("// scripts/gen_dynamic_map.py from tpamp.state_formats.dynamic_map; do not edit.")
    print("// Included by csrc/kernels/optimizer_step.h (TPAMP_TABLE, kDynamicSlots: see there).")
    print("#pragma once")
    print()
    for name, signed in (("Signed", True), ("Unsigned", False)):
        q = dynamic_map(signed).numpy()
        vals = [f32(v) for v in q] + [2.0]
        print(f"TPAMP_TABLE float kDynamicMap{name}[257] = {{")
        for i in range(0, 257, 4):
            print("    " + c_floats(vals[i:i + 4]) + ",")
        print("};")
        floors = table(q)
        print(f"TPAMP_TABLE uint8_t kDynamicFloor{name}[{len(floors)}] = {{")
        for i in range(0, len(floors), 24):
            print("    " + ", ".join(str(c) for c in floors[i:i + 24]) + ",")
        print("};")
        ts = thresholds(q)
        print(f"TPAMP_TABLE float kDynamicThreshold{name}[256] = {{")
        for i in range(0, 256, 4):
            print("    " + c_floats(ts[i:i + 4]) + ",")
        print("};")
        keyed = key_table(q, ts)
        print(f"TPAMP_TABLE uint32_t kDynamicKeyed{name}[{len(keyed)}] = {{")
        for i in range(0, len(keyed), 8):
            print("    " + ", ".join(f"0x{c:x}u" for c in keyed[i:i + 8]) + ",")
        print("};")


def main_python():
    print('"""The 256 float32 values of the uint8 moment format\'s dynamic quantization maps (code c')
    print("means SIGNED[c] for exp_avg, UNSIGNED[c] for exp_avg_sq, times the block's scale), as")
    print("hex floats: generated by scripts/gen_dynamic_map.py --python from")
    print("tpamp.state_formats.create_dynamic_map at the AVX-512 capability, the values of")
    print("csrc/kernels/dynamic_map_tables.h; do not edit. Kept fixed because the float32 rounding of")
    print('torch\'s linspace depends on the ATen CPU capability."""')
    print()
    for name, signed in (("SIGNED", True), ("UNSIGNED", False)):
        q = create_dynamic_map(signed).numpy()
        hexes = [re.sub(r"\.?0*p", "p", float(f32(v)).hex()) for v in q]
        print(f"{name} = (")
        for i in range(0, 256, 4):
            print("    " + " ".join(f'"{h}",' for h in hexes[i:i + 4]))
        print(")")
        print()

# -- the AVX2 encode's piece tables (--pieces: csrc/cpu/dynamic_map_pieces.h) -----------------

PIECE_FRAC_BITS = 12  # t within 2^-12 of an integer: the lane takes the keyed scalar path
PIECE_EPS = 2.0 ** -PIECE_FRAC_BITS


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def piece_tables(q, ts, signed):
    """The tables of the AVX2 encode (csrc/cpu/dynamic_map_simd.h). The magnitude code k
    (signed: code = 127 +- k, saturated to [0, 255]; unsigned: code = k, 0 for y < 0) of a =
    min(|y|, 1) is min(floor(a * A[p] + B[p]), hi[p]) on the piece p of a. The
    pieces start at the first code of every decade of the map (compared exactly on the bits of
    a); A and B are fitted so that t = a * A + B crosses the integer j at the threshold of k >= j
    inside the piece, within PIECE_EPS / 8. Scale and offset are stored times 2^PIECE_FRAC_BITS (exactly), the offset
    plus 1 (see dynamic_encode_block)."""
    ts = [np.float32(t) for t in ts]
    if signed:
        mag = [None] + [ts[126 + j] for j in range(1, 129)]  # k >= j <=> y >= mag[j]
        trans, kmax = [2, 4, 8, 16, 32, 64, 128], 128
    else:
        mag = [None] + [ts[j - 1] for j in range(1, 256)]
        trans, kmax = [3, 7, 15, 31, 63, 127, 255], 255
    bounds = [0] + trans + [kmax + 1]
    sc = 2.0 ** PIECE_FRAC_BITS
    A, B, hi = [], [], []
    for p in range(8):
        lo, up = bounds[p], bounds[p + 1]
        js = list(range(max(lo + 1, 1), up))
        if p == 7:
            a, b = 0.0, kmax + 0.5
        elif len(js) == 1 or (signed and p == 0):  # two points: j -> j, j + 1 -> j + 1
            j = js[-1]
            a = 1.0 / (float(mag[j + 1]) - float(mag[j]))
            b = j - a * float(mag[j])
        else:
            ys = np.array([float(mag[j]) for j in js])
            a, b = np.polyfit(ys, np.array(js, dtype=np.float64), 1)
        a4, b4 = np.float32(a * sc), np.float32(b * sc + 1.0)
        A.append(a4)
        B.append(b4)
        hi.append(up - 1)

        def t_of(y):
            return (float(np.float32(np.float64(y) * np.float64(a4) + np.float64(b4))) - 1.0) / sc

        for j in js:  # each interior threshold lands within PIECE_EPS / 8 of its integer
            assert abs(t_of(mag[j]) - j) < PIECE_EPS / 8, (signed, p, j, t_of(mag[j]))
        if p < 7:
            lo_y = 0.0 if p == 0 else float(mag[lo])
            f = t_of(lo_y) % 1.0
            assert PIECE_EPS * 4 < f < 1 - PIECE_EPS * 4, (signed, p, f)  # the start: unflagged
    starts = [f32_bits(mag[j]) - 1 for j in trans] + [0x7FFFFFFF]  # piece p + 1 iff key > starts[p]
    return A, B, hi, starts


def piece_binades(starts, bias):
    """plo[i] for the binade pairs i = max(E - bias, 0) >> 1 (E: biased exponent of a <= 1): the
    pieces wholly below the pair; every pair holds at most one transition."""
    assert bias % 2 == 0
    out = []
    for i in range(16):
        e_lo = 0 if i == 0 else bias + 2 * i
        e_hi = bias + 2 * i + 1
        key_lo = (e_lo << 23) - 2  # negative lanes: key = bits - 2
        key_hi = min(((e_hi + 1) << 23) - 1, 0x3F800000) + 1
        plo = sum(1 for s in starts[:7] if s < key_lo)
        inside = sum(1 for s in starts[:7] if key_lo <= s < key_hi)
        assert inside <= 1, (i, inside)
        out.append(plo)
    assert out[0] == 0
    return out


PIECE_BIAS = 106


def main_pieces():
    print("// The piece tables of the AVX2 uint8 encode (csrc/cpu/dynamic_map_simd.h): generated by")
    print("// scripts/gen_dynamic_map.py --pieces from tpamp.state_formats.dynamic_map; do not edit.")
    print("#pragma once")
    print()
    print("#include <cstdint>")
    print()
    print(f"constexpr int kDynamicPieceBias = {PIECE_BIAS};  // binade pair i = max(E - bias, 0) >> 1")
    print(f"constexpr int kDynamicPieceFracBits = {PIECE_FRAC_BITS};  // t in fixed point: bits below the point")
    for name, signed in (("Signed", True), ("Unsigned", False)):
        q = dynamic_map(signed).numpy()
        ts = thresholds(q)
        A, B, hi, starts = piece_tables(q, ts, signed)
        binades = piece_binades(starts, PIECE_BIAS)
        print(f"alignas(32) static constexpr float kDynamicPieceScale{name}[8] = "
              f"{{{c_floats(A)}}};")
        print(f"alignas(32) static constexpr float kDynamicPieceOffset{name}[8] = "
              f"{{{c_floats(B)}}};")
        print(f"alignas(32) static constexpr int32_t kDynamicPieceTop{name}[8] = "
              f"{{{', '.join(str(h) for h in hi)}}};")
        print(f"alignas(32) static constexpr int32_t kDynamicPieceStart{name}[8] = "
              f"{{{', '.join(str(s) for s in starts)}}};")
        print(f"alignas(32) static constexpr uint8_t kDynamicPieceBinade{name}[32] = "
              f"{{{', '.join(str(b) for b in binades + binades)}}};")


if __name__ == "__main__":
    if sys.argv[1:] == ["--python"]:
        main_python()
    elif sys.argv[1:] == ["--pieces"]:
        main_pieces()
    else:
        main()
