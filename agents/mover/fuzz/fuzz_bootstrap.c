// SPDX-License-Identifier: Apache-2.0
/*
 * libFuzzer target: the bootstrap socket's two messages (fm_hello_check on the
 * receiver, fm_welcome_check on the sender).  The socket read is exact-size
 * (fm_oob_recv_all), so a short input is what a peer that closed early leaves:
 * the rest of the struct stays as the caller initialised it (zero).  An
 * accepted message must carry the right credential and an address that fits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"

static const char token[FM_TOKEN_LEN] = "0123456789abcdef0123456789abcdef"
					"0123456789abcdef0123456789abcde";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct fm_hello h = {0};
	struct fm_welcome w = {0};

	if (size < 1)
		return 0;
	if (data[0] & 1) {
		memcpy(&h, data + 1, size - 1 < sizeof(h) ? size - 1 : sizeof(h));
		if (!fm_hello_check(&h, token) &&
		    (h.magic != FM_MAGIC || h.version != FM_VERSION ||
		     memcmp(h.token, token, FM_TOKEN_LEN) || !h.addr_len ||
		     h.addr_len > sizeof(h.addr)))
			abort();
	} else {
		memcpy(&w, data + 1, size - 1 < sizeof(w) ? size - 1 : sizeof(w));
		if (!fm_welcome_check(&w) &&
		    (w.magic != FM_MAGIC || w.version != FM_VERSION || !w.slots || !w.slot_size ||
		     !w.addr_len || w.addr_len > sizeof(w.addr)))
			abort();
	}
	return 0;
}
