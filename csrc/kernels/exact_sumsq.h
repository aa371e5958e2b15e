// The math of tpamp::grad_sumsq_exact and tpamp::exact_sumsq_to_double, shared by
// csrc/cpu/exact_sumsq.cpp and csrc/cuda/exact_sumsq.cu (design: the exact, order-invariant sum
// of squares of the grad norm; the Python side is tpamp/exact_sum.py).
//
// The exact representation ("digits"). For a float32 value r with IEEE-754 bits b:
//   E = (b >> 23) & 0xff, F = b & 0x7fffff; M = F | 0x800000 and E' = E (normal), M = F and
//   E' = 1 (E == 0: zero or subnormal). Then |r| = M 2^(E' - 150) and
//   r^2 = M^2 2^q 2^-298 with q = 2 E' - 2 (0 <= q <= 506), M^2 < 2^48 an exact integer.
//   E == 255 (inf, NaN) contributes nothing (found_inf is another statistic's job).
// The exact sum S = sum r^2 is the integer X = sum M^2 2^q in units of 2^-298, held as
// kExactDigits = 26 base-2^24 digits: S = sum_i digits[i] 2^(24 i - 298). "Normalized": every
// digit an integer in [0, 2^24), the top one (25) holding the rest (it stays below 2^24 for fewer
// than 2^62 values). The normalized form of S is unique, so it does not depend on how the values
// were split over tensors, chunks, threads, blocks or ranks: integer additions are exact and
// commute.
//
// How the launchers sum (order-invariant, no float arithmetic): per chunk, M^2 is added to a bin
// per biased exponent E (uint64: a chunk has at most kChunkSize = 2^16 values, and
// 2^16 (2^24 - 1)^2 < 2^64); at the end of the chunk each bin v (E < 255) is added, shifted by q,
// as four 24-bit pieces into int64 digits (exact_bin_pieces), and the chunk's digits are
// normalized; normalized digit vectors are then added (each digit grows by < 2^24 per vector:
// 2^39 vectors fit an int64) and normalized once more.
//
// Conversion (exact_digits_to_double): float64 digits that are integers in [0, 2^53) (e.g. a sum
// of normalized vectors over ranks), not necessarily normalized, to the float64 nearest
// S (round to nearest, ties to even). S is 0 or at least 2^-298 and below 2^400: always a normal
// float64, never inf. Then S equals math.fsum([float(r) ** 2 for r in values]) bit for bit.

#pragma once

#include "common.h"

#include <cstdint>
#include <cstring>

namespace tpamp {

constexpr int kExactDigits = 26;      // digits of the exact sum (float64 [26] on the wire)
constexpr int kExactDigitBits = 24;   // base 2^24
constexpr int kExactUnitExp = -298;   // digit i weighs 2^(24 i + kExactUnitExp)
constexpr int kExactBins = 256;       // one bin per biased exponent; bin 255 (inf/NaN) is unused
constexpr int kExactNonFiniteBin = 255;
constexpr int64_t kExactDigitMask = (int64_t{1} << kExactDigitBits) - 1;
// The conversion's working width: 26 digits of up to 2^53 carried into base 2^24 need 28.
constexpr int kExactWideDigits = kExactDigits + 2;

TPAMP_INLINE uint32_t exact_float_bits(float r) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(r);
#else
  uint32_t b;
  std::memcpy(&b, &r, sizeof(b));
  return b;
#endif
}

TPAMP_INLINE double exact_double_from_bits(uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  double d;
  std::memcpy(&d, &b, sizeof(d));
  return d;
#endif
}

// One value r: its bin (the biased exponent E; kExactNonFiniteBin for inf/NaN, whose bin the
// launchers never read) and M^2 (< 2^48).
struct ExactSquare {
  uint32_t bin;
  uint64_t m2;
};

TPAMP_INLINE ExactSquare exact_square(float r) {
  const uint32_t b = exact_float_bits(r);
  const uint32_t e = (b >> 23) & 0xffu;
  const uint64_t m = static_cast<uint64_t>((b & 0x7fffffu) | (e != 0 ? 0x800000u : 0u));
  return {e, m * m};
}

// A bin's total v (a sum of M^2 of values with biased exponent `bin` < 255, any v < 2^64) as
// v 2^q = sum_k pieces[k] 2^(24 (d + k)) with pieces[k] < 2^24: the four int64 digits d .. d + 3
// it adds to (d <= 21, so d + 3 < kExactDigits).
TPAMP_INLINE int exact_bin_pieces(uint32_t bin, uint64_t v, uint64_t pieces[4]) {
  const int q = 2 * static_cast<int>(bin == 0 ? 1u : bin) - 2;
  const int d = q / kExactDigitBits;
  const int s = q - d * kExactDigitBits;  // 0 .. 23
  const uint64_t mask = static_cast<uint64_t>(kExactDigitMask);
  pieces[0] = (v << s) & mask;
  const uint64_t rest = v >> (kExactDigitBits - s);  // the bits above piece 0; < 2^(40 + s)
  pieces[1] = rest & mask;
  pieces[2] = (rest >> 24) & mask;
  pieces[3] = rest >> 48;  // < 2^15
  return d;
}

// Carries non-negative int64 digits[0 .. n) into [0, 2^24), the last digit keeping the rest.
TPAMP_INLINE void exact_normalize(int64_t* digits, int n) {
  int64_t carry = 0;
  for (int i = 0; i + 1 < n; ++i) {
    const int64_t x = digits[i] + carry;
    digits[i] = x & kExactDigitMask;
    carry = x >> kExactDigitBits;
  }
  digits[n - 1] += carry;
}

// Whether one float64 digit of the conversion's input is an integer in [0, 2^53).
TPAMP_INLINE bool exact_digit_ok(double v) {
  if (!(v >= 0.0 && v < 9007199254740992.0)) return false;  // NaN fails too
  return static_cast<double>(static_cast<int64_t>(v)) == v;
}

// The float64 nearest sum_i in[i] 2^(24 i - 298) (ties to even), for in[0 .. kExactDigits) each
// an integer in [0, 2^53); NaN when an entry is not (exact_digit_ok).
TPAMP_INLINE double exact_digits_to_double(const double* in) {
  int64_t w[kExactWideDigits];
  int64_t carry = 0;
  bool ok = true;
  for (int i = 0; i < kExactWideDigits; ++i) {
    int64_t x = carry;
    if (i < kExactDigits) {
      const double v = in[i];
      const bool good = exact_digit_ok(v);
      ok = ok && good;
      x += good ? static_cast<int64_t>(v) : 0;
    }
    w[i] = x & kExactDigitMask;
    carry = x >> kExactDigitBits;
  }
  if (!ok) return exact_double_from_bits(0x7ff8000000000000ull);
  int h = kExactWideDigits - 1;
  while (h >= 0 && w[h] == 0) --h;
  if (h < 0) return 0.0;
  int top_bits = 0;  // bit length of w[h], 1 .. 24
  while ((w[h] >> top_bits) != 0) ++top_bits;
  const int length = kExactDigitBits * h + top_bits;  // bit length of X
  // The 54 leading bits of X (53 + the round bit): window = floor(X / 2^shift), in
  // [2^53, 2^54); sticky: any 1 bit below them.
  int shift = length - 54;
  uint64_t window = 0;
  bool sticky = false;
  for (int i = 0; i <= h; ++i) {
    const uint64_t digit = static_cast<uint64_t>(w[i]);
    const int pos = kExactDigitBits * i - shift;  // where the digit's bit 0 lands in the window
    if (pos >= 0) {
      window += digit << pos;
    } else if (pos > -kExactDigitBits) {
      window += digit >> (-pos);
      sticky = sticky || (digit & ((uint64_t{1} << (-pos)) - 1)) != 0;
    } else {
      sticky = sticky || digit != 0;
    }
  }
  uint64_t m = window >> 1;  // [2^52, 2^53)
  const bool round = (window & 1) != 0;
  if (round && (sticky || (m & 1) != 0)) ++m;
  if (m == (uint64_t{1} << 53)) {
    m >>= 1;
    ++shift;
  }
  // value = m 2^(shift + 1 - 298) = 1.f 2^(shift - 245): biased exponent shift + 778, which is
  // in [725, 1396] for 1 <= length <= 24 * 28: always a normal float64
  const uint64_t biased = static_cast<uint64_t>(shift + 1 + 52 + kExactUnitExp + 1023);
  return exact_double_from_bits((biased << 52) | (m - (uint64_t{1} << 52)));
}

}  // namespace tpamp
