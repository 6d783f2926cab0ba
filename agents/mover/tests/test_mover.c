// SPDX-License-Identifier: Apache-2.0
/* Unit tests of the mover's pure parts: CRC32C, framing, ring credits.  No root. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "crc32c.h"
#include "frame.h"
#include "ring.h"

static int failures, checks;

#define CHECK(cond)                                                                  \
	do {                                                                         \
		checks++;                                                            \
		if (!(cond)) {                                                       \
			failures++;                                                  \
			fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
		}                                                                    \
	} while (0)

static void test_crc32c(void)
{
	static char big[100003];
	size_t i;

	/* RFC 3720 / iSCSI check values. */
	CHECK(fm_crc32c(0, "123456789", 9) == 0xe3069283u);
	memset(big, 0, 32);
	CHECK(fm_crc32c(0, big, 32) == 0x8a9136aau);
	memset(big, 0xff, 32);
	CHECK(fm_crc32c(0, big, 32) == 0x62a8ab43u);
	for (i = 0; i < sizeof(big); i++)
		big[i] = (char)(i * 7 + 3);
	/* Chaining equals one pass; one flipped bit changes the sum. */
	CHECK(fm_crc32c(fm_crc32c(0, big, 5001), big + 5001, sizeof(big) - 5001) ==
	      fm_crc32c(0, big, sizeof(big)));
	{
		uint32_t before = fm_crc32c(0, big, sizeof(big));

		big[77777] ^= 0x10;
		CHECK(fm_crc32c(0, big, sizeof(big)) != before);
	}
}

static void test_frames(void)
{
	struct fm_msg m = {.type = FM_MSG_BATCH, .len = 4096, .slot = 3};

	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == 0);
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN - 1, 8, 4096) == -EPROTO); /* truncated */
	m.slot = 8;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == -EPROTO); /* slot out of ring */
	m.slot = 0;
	m.len = 4097;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == -EPROTO); /* longer than a slot */
	m.len = 0;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == -EPROTO);
	m.type = FM_MSG_REVERSE;
	m.len = 100;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN + 100, 8, 4096) == 0);
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN + 99, 8, 4096) == -EPROTO);
	m.len = FM_REVERSE_MAX + 1;
	CHECK(fm_msg_check(&m, sizeof(m), 8, 4096) == -EPROTO);
	m.type = 99;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == -EPROTO);
	m.type = FM_MSG_CREDIT;
	CHECK(fm_msg_check(&m, FM_MSG_HDR_LEN, 8, 4096) == 0);
}

static void test_ring(void)
{
	struct fm_ring snd, rcv;
	uint64_t seq;
	uint32_t slot;
	int i;

	CHECK(fm_ring_init(&snd, 0, 1) == -EINVAL);
	CHECK(fm_ring_init(&snd, 4, 8) == 0 && snd.depth == 4); /* depth capped by slots */
	CHECK(fm_ring_init(&rcv, 4, 4) == 0);
	for (i = 0; i < 4; i++) {
		CHECK(fm_ring_can_send(&snd));
		slot = fm_ring_claim(&snd, &seq);
		CHECK(seq == (uint64_t)i && slot == (uint32_t)i);
	}
	CHECK(!fm_ring_can_send(&snd)); /* no credit: the fifth batch waits */
	CHECK(fm_ring_accept(&rcv, 1, 1) == -EPROTO); /* out of order */
	CHECK(fm_ring_accept(&rcv, 0, 1) == -EPROTO); /* wrong slot */
	CHECK(fm_ring_accept(&rcv, 0, 0) == 0);
	CHECK(fm_ring_credit(&snd, 1) == 0 && fm_ring_can_send(&snd));
	slot = fm_ring_claim(&snd, &seq);
	CHECK(seq == 4 && slot == 0); /* wraps into the credited slot */
	CHECK(fm_ring_credit(&snd, 0) == -EPROTO);  /* credit going backwards */
	CHECK(fm_ring_credit(&snd, 99) == -EPROTO); /* credit for unsent batches */
	CHECK(fm_ring_in_flight(&snd) == 4);
}

int main(void)
{
	test_crc32c();
	test_frames();
	test_ring();
	printf("%d passed, %d failed\n", checks - failures, failures);
	return failures ? 1 : 0;
}
