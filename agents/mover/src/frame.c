// SPDX-License-Identifier: Apache-2.0
#include "frame.h"

#include <errno.h>

int fm_msg_check(const struct fm_msg *msg, size_t got, uint32_t slots, uint32_t slot_size)
{
	if (got < FM_MSG_HDR_LEN)
		return -EPROTO;
	switch (msg->type) {
	case FM_MSG_BATCH:
		if (msg->slot >= slots || msg->len == 0 || msg->len > slot_size)
			return -EPROTO;
		return got == FM_MSG_HDR_LEN ? 0 : -EPROTO;
	case FM_MSG_REVERSE:
		if (msg->len == 0 || msg->len > FM_REVERSE_MAX)
			return -EPROTO;
		return got == FM_MSG_HDR_LEN + msg->len ? 0 : -EPROTO;
	case FM_MSG_CREDIT:
	case FM_MSG_FIN:
	case FM_MSG_ERROR:
		return got == FM_MSG_HDR_LEN ? 0 : -EPROTO;
	default:
		return -EPROTO;
	}
}
