// SPDX-License-Identifier: Apache-2.0
#include "ring.h"

#include <errno.h>

int fm_ring_init(struct fm_ring *r, uint32_t slots, uint32_t depth)
{
	if (slots == 0 || depth == 0)
		return -EINVAL;
	r->slots = slots;
	r->depth = depth < slots ? depth : slots;
	r->next_seq = r->credited_seq = r->expect_seq = 0;
	return 0;
}

uint32_t fm_ring_in_flight(const struct fm_ring *r)
{
	return (uint32_t)(r->next_seq - r->credited_seq);
}

int fm_ring_can_send(const struct fm_ring *r)
{
	return fm_ring_in_flight(r) < r->depth;
}

uint32_t fm_ring_claim(struct fm_ring *r, uint64_t *seq)
{
	*seq = r->next_seq++;
	return (uint32_t)(*seq % r->slots);
}

int fm_ring_credit(struct fm_ring *r, uint64_t upto)
{
	if (upto < r->credited_seq || upto > r->next_seq)
		return -EPROTO;
	r->credited_seq = upto;
	return 0;
}

int fm_ring_accept(struct fm_ring *r, uint64_t seq, uint32_t slot)
{
	if (seq != r->expect_seq || slot != seq % r->slots)
		return -EPROTO;
	r->expect_seq++;
	return 0;
}
