/* Row digests: see rowdigest.h for the function and why it is exact where it must be.
 *
 * Why C: this is the whole CPU cost of deciding what a delta writes (every tracked row is hashed
 * at every save). Torch's vectorised version needs five passes over int64 temporaries per block
 * (multiply, shift, mask, xor, multiply, then a row sum); this loop reads each word once and
 * keeps everything in registers, and runs without the GIL. */
#include "rowdigest.h"

#include <string.h>

static inline uint64_t mix(uint64_t w, uint64_t m)
{
    uint64_t x = w * m;
    x ^= x >> 32;
    return x * ROWDIGEST_Q;
}

/* One loop per word size, so the load is a plain typed load the compiler can schedule. memcpy
 * keeps unaligned rows (a row of 3 int16 words starts at any even address) well defined. */
#define ROW_LOOP(T)                                                              \
    for (size_t i = 0; i < n; i++) {                                             \
        const uint8_t *r = base + (ptrdiff_t)i * stride;                         \
        uint64_t s0 = 0, s1 = 0;                                                 \
        size_t j = 0;                                                            \
        for (; j + 2 <= width; j += 2) {                                         \
            T a, b;                                                              \
            memcpy(&a, r + j * sizeof(T), sizeof(T));                            \
            memcpy(&b, r + (j + 1) * sizeof(T), sizeof(T));                      \
            s0 += mix((uint64_t)a, mult[j]);                                     \
            s1 += mix((uint64_t)b, mult[j + 1]);                                 \
        }                                                                        \
        if (j < width) {                                                         \
            T a;                                                                 \
            memcpy(&a, r + j * sizeof(T), sizeof(T));                            \
            s0 += mix((uint64_t)a, mult[j]);                                     \
        }                                                                        \
        out[i] = s0 + s1;                                                        \
    }

void row_digests(const uint8_t *base, size_t n, ptrdiff_t stride, size_t width, int word,
                 const uint64_t *mult, uint64_t *out)
{
    switch (word) {
    case 8: ROW_LOOP(uint64_t) break;
    case 4: ROW_LOOP(uint32_t) break;
    case 2: ROW_LOOP(uint16_t) break;
    default: ROW_LOOP(uint8_t) break;
    }
}
