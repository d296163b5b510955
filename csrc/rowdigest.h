/* Row digests of incremental checkpoints (distckpt/incremental.py, docs/INCREMENTAL.md).
 *
 * A row is `width` words of `word` bytes (1, 2, 4 or 8; little-endian, zero-extended to 64 bits),
 * contiguous in memory. Word j of value w becomes x = w * mult[j], then x ^= x >> 32, then
 * x *= ROWDIGEST_Q (all mod 2^64; mult[j] and Q odd, so every step is a bijection of the word),
 * and a row's digest is the sum of its words' x. A change confined to one word therefore always
 * changes the digest; any other change escapes with probability about 2^-64. */
#ifndef DISTCKPT_ROWDIGEST_H
#define DISTCKPT_ROWDIGEST_H
#include <stddef.h>
#include <stdint.h>

#define ROWDIGEST_Q 0x9E3779B97F4A7C15ULL

/* out[i] = digest of the row at base + i * stride, for i < n. word must be 1, 2, 4 or 8.
 * Pure computation on caller-owned memory: safe to call without the GIL, from several threads. */
void row_digests(const uint8_t *base, size_t n, ptrdiff_t stride, size_t width, int word,
                 const uint64_t *mult, uint64_t *out);

#endif
