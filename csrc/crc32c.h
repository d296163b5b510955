/* CRC-32C (Castagnoli), the checksum distckpt's MANIFEST records per checksum block.
 * crc32c_update(0, buf, len) equals crc32c.crc32c(buf) of the `crc32c` package. Thread-safe once
 * crc32c_init() has run (it builds tables and picks the hardware path; call it at module init). */
#ifndef DISTCKPT_CRC32C_H
#define DISTCKPT_CRC32C_H
#include <stddef.h>
#include <stdint.h>

void crc32c_init(void);
uint32_t crc32c_update(uint32_t crc, const void *buf, size_t len);
/* The table fallback on its own (tests compare both paths). */
uint32_t crc32c_software(uint32_t crc, const void *buf, size_t len);
/* 1 when crc32c_update uses the CPU's crc32 instruction (SSE4.2), 0 for the table fallback. */
int crc32c_hardware(void);

#endif
