/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_CRC32C_H
#define FM_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC32C (Castagnoli), as iSCSI and ext4 use it; SSE4.2 when the CPU has it. */
uint32_t fm_crc32c(uint32_t crc, const void *buf, size_t len);

#endif
