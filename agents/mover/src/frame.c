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

int fm_token_check(const char *presented, const char *expected)
{
	unsigned char diff = 0;
	int i;

	for (i = 0; i < FM_TOKEN_LEN; i++)
		diff |= (unsigned char)(presented[i] ^ expected[i]);
	return diff == 0 ? 0 : -EACCES;
}

int fm_hello_check(const struct fm_hello *h, const char *token)
{
	if (h->magic != FM_MAGIC || h->version != FM_VERSION || fm_token_check(h->token, token))
		return -EACCES;
	if (h->addr_len == 0 || h->addr_len > sizeof(h->addr))
		return -EPROTO;
	return 0;
}

int fm_welcome_check(const struct fm_welcome *w)
{
	if (w->magic != FM_MAGIC || w->version != FM_VERSION)
		return -EACCES;
	if (w->slots == 0 || w->slot_size == 0 || w->addr_len == 0 || w->addr_len > sizeof(w->addr))
		return -EPROTO;
	return 0;
}
