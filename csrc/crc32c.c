/*
 * CRC-32C for the load path's verify-then-copy (see csrc/reader.c, Reader.fill).
 *
 * Hardware path, chosen at run time: the CPU's CRC-32C instruction (x86-64 with SSE4.2: crc32;
 * AArch64 with the CRC extension, every ARMv8.1 CPU: crc32cx) on three interleaved streams, whose
 * CRCs are combined with precomputed "append N zero bytes" operators. This is Mark Adler's method
 * (crc32c.c, zlib licence, as also used by the `crc32c` package); one stream is bound by the
 * instruction's 3-cycle latency, three streams by its throughput.
 * Fallback: a byte-at-a-time table (slow but correct; other CPUs).
 */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82f63b78u

static uint32_t table[256];
static int have_hw;

/* GF(2) matrix (32 x 32, one uint32 per column) times vector. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes (len a power of two, >= 1) to a raw CRC. */
static void zeros_op(uint32_t *even, size_t len)
{
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    /* Each pass squares twice: 8 bits (1 byte), then 2 bytes, 4 bytes... */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

/* Byte-indexed tables of an operator, so applying it costs four lookups. */
static void zeros_tables(uint32_t zeros[4][256], size_t len)
{
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc)
{
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

#define LONG 8192
#define SHORT 256
static uint32_t long_zeros[4][256], short_zeros[4][256];

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len)
{
    crc = ~crc;
    while (len--)
        crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
#include <nmmintrin.h>
#define HW_TARGET __attribute__((target("sse4.2")))
#define CRC_WORD(crc, w) _mm_crc32_u64((crc), (w))
#define CRC_BYTE(crc, b) _mm_crc32_u8((uint32_t)(crc), (b))
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#define HW_TARGET __attribute__((target("+crc")))
#define CRC_WORD(crc, w) __crc32cd((uint32_t)(crc), (w))
#define CRC_BYTE(crc, b) __crc32cb((uint32_t)(crc), (b))
#endif

#ifdef HW_TARGET

/* An unaligned 8-byte load (memcpy compiles to one load instruction). */
static inline uint64_t load64(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three interleaved crc32 streams over lanes of ``lane`` bytes (the instruction's latency is
   three times its throughput), combined by shifting through ``zeros`` (lane bytes of zeros). */
HW_TARGET static inline uint64_t crc_lanes(uint64_t crc0, const unsigned char **pnext,
                                                                 size_t *plen, size_t lane,
                                                                 uint32_t zeros[4][256])
{
    const unsigned char *next = *pnext;
    size_t len = *plen;
    while (len >= lane * 3) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + lane;
        /* Four words per stream per pass (lanes are multiples of 32 bytes): with one, the loop's
           own add/compare/branch takes issue slots from the crc32s (~20 % slower on x86-64). */
        do {
            crc0 = CRC_WORD(crc0, load64(next));
            crc1 = CRC_WORD(crc1, load64(next + lane));
            crc2 = CRC_WORD(crc2, load64(next + 2 * lane));
            crc0 = CRC_WORD(crc0, load64(next + 8));
            crc1 = CRC_WORD(crc1, load64(next + lane + 8));
            crc2 = CRC_WORD(crc2, load64(next + 2 * lane + 8));
            crc0 = CRC_WORD(crc0, load64(next + 16));
            crc1 = CRC_WORD(crc1, load64(next + lane + 16));
            crc2 = CRC_WORD(crc2, load64(next + 2 * lane + 16));
            crc0 = CRC_WORD(crc0, load64(next + 24));
            crc1 = CRC_WORD(crc1, load64(next + lane + 24));
            crc2 = CRC_WORD(crc2, load64(next + 2 * lane + 24));
            next += 32;
        } while (next < end);
        crc0 = shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc1;
        crc0 = shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc2;
        next += 2 * lane;
        len -= 3 * lane;
    }
    *pnext = next;
    *plen = len;
    return crc0;
}

HW_TARGET static uint32_t crc_hw(uint32_t crc, const unsigned char *next, size_t len)
{
    uint64_t crc0 = ~crc & 0xffffffffu;
    uint64_t w;

    while (len && ((uintptr_t)next & 7)) {
        crc0 = CRC_BYTE(crc0, *next++);
        len--;
    }
    crc0 = crc_lanes(crc0, &next, &len, LONG, long_zeros);
    crc0 = crc_lanes(crc0, &next, &len, SHORT, short_zeros);
    while (len >= 8) {
        memcpy(&w, next, 8);
        crc0 = CRC_WORD(crc0, w);
        next += 8;
        len -= 8;
    }
    while (len) {
        crc0 = CRC_BYTE(crc0, *next++);
        len--;
    }
    return ~(uint32_t)crc0;
}
#endif

void crc32c_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[n] = c;
    }
    zeros_tables(long_zeros, LONG);
    zeros_tables(short_zeros, SHORT);
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2") != 0;
#elif defined(__aarch64__)
    have_hw = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#endif
}

int crc32c_hardware(void) { return have_hw; }

uint32_t crc32c_software(uint32_t crc, const void *buf, size_t len) { return crc_sw(crc, buf, len); }

uint32_t crc32c_update(uint32_t crc, const void *buf, size_t len)
{
#ifdef HW_TARGET
    if (have_hw)
        return crc_hw(crc, buf, len);
#endif
    return crc_sw(crc, buf, len);
}
