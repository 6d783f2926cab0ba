// SPDX-License-Identifier: Apache-2.0
/*
 * The receiving mover: owns the ring the sender writes into (registered once),
 * checks each batch's sequence and CRC32C before a byte goes on, delivers in
 * order to a file, stdout, or the socket the destination QEMU listens on, and
 * returns a credit per batch.  Bytes the destination QEMU writes back (the
 * postcopy return path) travel as REVERSE messages, never behind bulk data.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "oob.h"
#include "session.h"

static int open_output(struct fm_session *s)
{
	int fd;

	if (s->local_fd >= 0)
		return 0;
	/* The destination QEMU listens once libvirt has prepared it, which is
	 * before the source sends anything: connect at the first batch. */
	fd = fm_unix_connect_retry(s->cfg->connect_unix, s->cfg->timeout_s * 1000);
	if (fd < 0) {
		fprintf(stderr, "mover: connecting to %s: %s\n", s->cfg->connect_unix,
			strerror(-fd));
		return fd;
	}
	s->local_fd = fd;
	return 0;
}

static int reject(struct fm_session *s, uint64_t seq, int err)
{
	struct fm_msg msg = {.type = FM_MSG_ERROR, .seq = seq};

	fm_send_msg(s, &msg, FM_MSG_HDR_LEN);
	return err;
}

static int deliver_batch(struct fm_session *s, const struct fm_msg *msg)
{
	struct fm_msg credit = {.type = FM_MSG_CREDIT};
	const char *slot;
	int ret;

	if (fm_ring_accept(&s->ring, msg->seq, msg->slot)) {
		fprintf(stderr, "mover: batch %llu out of sequence (expected %llu)\n",
			(unsigned long long)msg->seq, (unsigned long long)s->ring.expect_seq);
		return reject(s, msg->seq, -EPROTO);
	}
	slot = (const char *)s->data.buf + (size_t)msg->slot * s->slot_size;
	if (fm_crc32c(0, slot, msg->len) != msg->crc) {
		fprintf(stderr, "mover: batch %llu failed its CRC32C check: corrupted in transit\n",
			(unsigned long long)msg->seq);
		return reject(s, msg->seq, -EBADMSG);
	}
	ret = open_output(s);
	if (!ret)
		ret = fm_write_all(s->local_fd, slot, msg->len);
	if (ret)
		return reject(s, msg->seq, ret);
	if (s->stats.bytes == 0)
		s->stats.seconds = fm_now();
	s->stats.bytes += msg->len;
	s->stats.batches++;
	credit.seq = msg->seq + 1;
	return fm_send_msg(s, &credit, FM_MSG_HDR_LEN);
}

static int receiver_done(struct fm_session *s, struct fm_op *op, size_t len)
{
	struct fm_msg *msg = fm_rx_msg(s, op->index);
	struct fm_msg fin = {.type = FM_MSG_FIN};
	int ret = 0;

	if (op->kind != FM_OP_RECV || fm_msg_check(msg, len, s->ring.slots, s->slot_size)) {
		fprintf(stderr, "mover: malformed message from the sender\n");
		return -EPROTO;
	}
	switch (msg->type) {
	case FM_MSG_BATCH:
		ret = deliver_batch(s, msg);
		break;
	case FM_MSG_FIN:
		if (msg->seq != s->stats.bytes) {
			fprintf(stderr, "mover: truncated: the sender sent %llu bytes, %llu arrived\n",
				(unsigned long long)msg->seq, (unsigned long long)s->stats.bytes);
			return -EPROTO;
		}
		fin.seq = s->stats.bytes;
		s->fin_received = 1;
		ret = fm_send_msg(s, &fin, FM_MSG_HDR_LEN);
		break;
	case FM_MSG_ERROR:
		fprintf(stderr, "mover: the sender aborted the transfer\n");
		return -EPROTO;
	default:
		return -EPROTO;
	}
	if (ret)
		return ret;
	return fm_post_recv(s, op->index);
}

/* Return path: whatever the destination QEMU writes goes back as REVERSE. */
static int forward_reverse(struct fm_session *s, int *closed)
{
	struct pollfd p = {.fd = s->local_fd, .events = POLLIN};
	struct fm_msg msg = {.type = FM_MSG_REVERSE};
	ssize_t n;

	if (*closed || s->local_fd < 0 || !s->cfg->connect_unix || poll(&p, 1, 0) != 1)
		return 0;
	n = read(s->local_fd, msg.data, sizeof(msg.data));
	if (n <= 0) {
		*closed = 1; /* QEMU finished reading: the stream is done */
		return 0;
	}
	msg.len = (uint32_t)n;
	s->stats.reverse_bytes += (uint64_t)n;
	return fm_send_msg(s, &msg, FM_MSG_HDR_LEN + (size_t)n);
}

int fm_run_receiver(struct fm_session *s)
{
	int ret = 0, closed = 0;
	double seen = 0;

	s->on_done = receiver_done;
	s->last_progress = fm_now();
	while (!ret && !s->fin_received) {
		ret = fm_progress(s);
		if (!ret)
			ret = forward_reverse(s, &closed);
		if (!ret)
			ret = fm_check_peer(s, 0);
		if (!ret)
			ret = fm_idle(s, &seen);
	}
	/* Let the FIN reply leave before the endpoint closes. */
	for (int i = 0; i < 100 && !ret; i++) {
		ret = fm_progress(s);
		usleep(1000);
	}
	if (s->stats.seconds > 0)
		s->stats.seconds = fm_now() - s->stats.seconds;
	return ret;
}
