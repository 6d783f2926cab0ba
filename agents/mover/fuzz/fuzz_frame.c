// SPDX-License-Identifier: Apache-2.0
/*
 * libFuzzer target: the control messages one mover receives from the other
 * (fm_msg_check, exactly as the sender and receiver call it).  The first 8
 * bytes choose the ring geometry; the rest is the message as received.
 * Accepted messages must satisfy what the callers then rely on.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct fm_msg msg;
	uint32_t slots, slot_size;
	size_t got;

	if (size < 8)
		return 0;
	memcpy(&slots, data, 4);
	memcpy(&slot_size, data + 4, 4);
	data += 8;
	size -= 8;
	/* A message never exceeds its buffer: the fabric receive is posted with sizeof. */
	got = size < sizeof(msg) ? size : sizeof(msg);
	memset(&msg, 0xa5, sizeof(msg));
	memcpy(&msg, data, got);
	if (fm_msg_check(&msg, got, slots, slot_size))
		return 0;
	switch (msg.type) {
	case FM_MSG_BATCH:
		if (msg.slot >= slots || !msg.len || msg.len > slot_size || got != FM_MSG_HDR_LEN)
			abort();
		break;
	case FM_MSG_REVERSE:
		if (!msg.len || msg.len > FM_REVERSE_MAX || got != FM_MSG_HDR_LEN + msg.len)
			abort();
		break;
	case FM_MSG_CREDIT:
	case FM_MSG_FIN:
	case FM_MSG_ERROR:
		if (got != FM_MSG_HDR_LEN)
			abort();
		break;
	default:
		abort(); /* HELLO/WELCOME or unknown types are never valid here */
	}
	return 0;
}
