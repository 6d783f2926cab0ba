// SPDX-License-Identifier: Apache-2.0
/*
 * CRC32C over every batch: the receiver recomputes it before a byte reaches
 * QEMU, so corruption anywhere between the two movers is caught, not loaded.
 */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82f63b78u

static uint32_t table[256];
static int have_sse42 = -1;

static void init_table(void)
{
	uint32_t i, j, c;

	for (i = 0; i < 256; i++) {
		c = i;
		for (j = 0; j < 8; j++)
			c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
		table[i] = c;
	}
}

static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t len)
{
	while (len--)
		crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
	return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p,
							   size_t len)
{
	uint64_t c = crc;

	for (; len >= 8; len -= 8, p += 8) {
		uint64_t v;

		memcpy(&v, p, sizeof(v));
		c = __builtin_ia32_crc32di(c, v);
	}
	crc = (uint32_t)c;
	while (len--)
		crc = __builtin_ia32_crc32qi(crc, *p++);
	return crc;
}
#endif

uint32_t fm_crc32c(uint32_t crc, const void *buf, size_t len)
{
	if (have_sse42 < 0) {
		init_table();
#if defined(__x86_64__)
		__builtin_cpu_init();
		have_sse42 = __builtin_cpu_supports("sse4.2");
#else
		have_sse42 = 0;
#endif
	}
	crc = ~crc;
#if defined(__x86_64__)
	if (have_sse42)
		return ~crc_hw(crc, buf, len);
#endif
	return ~crc_soft(crc, buf, len);
}
