/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_RING_H
#define FM_RING_H

#include <stdint.h>

/*
 * Credit accounting for the receiver's ring of slots (pure logic).
 *
 * Batch n always lands in slot n % slots.  The sender may have at most
 * min(depth, slots) batches not yet returned as credit; the receiver consumes
 * strictly in sequence, so a batch arriving out of order is a protocol error.
 */
struct fm_ring {
	uint32_t slots;
	uint32_t depth;
	uint64_t next_seq;     /* sender: next batch to send */
	uint64_t credited_seq; /* sender: batches before this one are consumed */
	uint64_t expect_seq;   /* receiver: next batch to deliver */
};

int fm_ring_init(struct fm_ring *r, uint32_t slots, uint32_t depth);
/* Sender: may another batch go now? */
int fm_ring_can_send(const struct fm_ring *r);
/* Sender: claim the next batch; returns its slot.  Call only if can_send. */
uint32_t fm_ring_claim(struct fm_ring *r, uint64_t *seq);
/* Sender: the receiver consumed every batch before @upto. 0 or -EPROTO. */
int fm_ring_credit(struct fm_ring *r, uint64_t upto);
/* Receiver: batch @seq arrived in @slot; 0 if it is the expected one, else -EPROTO. */
int fm_ring_accept(struct fm_ring *r, uint64_t seq, uint32_t slot);
uint32_t fm_ring_in_flight(const struct fm_ring *r);

#endif
