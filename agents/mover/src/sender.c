// SPDX-License-Identifier: Apache-2.0
/*
 * The sending mover: reads the byte stream (a file, stdin, or the socket the
 * source QEMU connects to), fills batch buffers, RMA-writes each into the
 * receiver's ring and tells it with a BATCH message.  Up to `depth` batches
 * are in flight, so filling batch k+2, transferring k+1 and the receiver's
 * draining of k overlap (seed 000's pipeline).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "crc32c.h"
#include "oob.h"
#include "session.h"

static int fill_index = -1;

static char *buf_data(struct fm_session *s, int i)
{
	return (char *)s->data.buf + (size_t)i * s->slot_size;
}

static int sender_done(struct fm_session *s, struct fm_op *op, size_t len)
{
	struct fm_batch_buf *b;
	struct fm_msg *msg, out = {0};
	int ret = 0;

	if (op->kind == FM_OP_WRITE) {
		b = &s->bufs[op->index];
		out.type = FM_MSG_BATCH;
		out.len = (uint32_t)b->len;
		out.seq = b->seq;
		out.slot = b->slot;
		out.crc = b->crc;
		b->state = FM_BUF_FREE;
		return fm_send_msg(s, &out, FM_MSG_HDR_LEN);
	}
	msg = fm_rx_msg(s, op->index);
	if (fm_msg_check(msg, len, s->ring.slots, s->slot_size)) {
		fprintf(stderr, "mover: malformed message from the receiver\n");
		return -EPROTO;
	}
	switch (msg->type) {
	case FM_MSG_CREDIT:
		ret = fm_ring_credit(&s->ring, msg->seq);
		break;
	case FM_MSG_REVERSE:
		s->stats.reverse_bytes += msg->len;
		ret = fm_write_all(s->local_fd, msg->data, msg->len);
		break;
	case FM_MSG_FIN:
		s->fin_received = 1;
		break;
	case FM_MSG_ERROR:
		fprintf(stderr, "mover: the receiver aborted the transfer at batch %llu\n",
			(unsigned long long)msg->seq);
		return -EPROTO;
	default:
		return -EPROTO;
	}
	if (ret)
		return ret;
	return fm_post_recv(s, op->index);
}

static int post_write(struct fm_session *s, int i)
{
	struct fm_batch_buf *b = &s->bufs[i];
	struct iovec iov = {.iov_base = buf_data(s, i), .iov_len = b->len};
	void *desc = s->data.desc;
	struct fi_rma_iov rma;
	struct fi_msg_rma m = {0};
	uint64_t flags = FI_COMPLETION;
	ssize_t ret;

	b->slot = fm_ring_claim(&s->ring, &b->seq);
	if ((int64_t)b->seq == s->cfg->inject_corruption)
		buf_data(s, i)[b->len / 2] ^= 0x40; /* test hook: damage after the CRC */
	rma.addr = s->ring_addr + (uint64_t)b->slot * s->slot_size;
	rma.len = b->len;
	rma.key = s->ring_key;
	m.msg_iov = &iov;
	m.desc = &desc;
	m.iov_count = 1;
	m.addr = s->fab.peer;
	m.rma_iov = &rma;
	m.rma_iov_count = 1;
	m.context = &b->op.ctx;
	b->op.kind = FM_OP_WRITE;
	b->op.index = i;
	/* Without send-after-write ordering, the BATCH message may go only once
	 * the data has been placed at the target. */
	if (!s->fab.ordered)
		flags |= FI_DELIVERY_COMPLETE;
	b->state = FM_BUF_WRITING;
	while ((ret = fi_writemsg(s->fab.ep, &m, flags)) == -FI_EAGAIN) {
		int err = fm_progress(s);

		if (err)
			return err;
	}
	if (ret)
		fprintf(stderr, "mover: fi_writemsg: %s\n", fi_strerror((int)-ret));
	s->stats.batches++;
	return (int)ret;
}

/* Read without blocking: a socket (QEMU) with MSG_DONTWAIT, anything else once poll says so. */
static ssize_t read_input(struct fm_session *s, char *p, size_t len)
{
	struct pollfd pfd = {.fd = s->local_fd, .events = POLLIN};
	ssize_t n;

	if (s->input_is_socket) {
		n = recv(s->local_fd, p, len, MSG_DONTWAIT);
		if (n >= 0 || errno != ENOTSOCK)
			return n;
		s->input_is_socket = 0;
	}
	if (poll(&pfd, 1, 0) != 1) {
		errno = EAGAIN;
		return -1;
	}
	return read(s->local_fd, p, len);
}

/* A buffer to fill: the one being filled while it has room, else a free one. */
static struct fm_batch_buf *fill_buf(struct fm_session *s)
{
	int i;

	if (fill_index >= 0)
		return s->bufs[fill_index].len < s->slot_size ? &s->bufs[fill_index] : NULL;
	for (i = 0; i <= (int)s->ring.depth; i++)
		if (s->bufs[i].state == FM_BUF_FREE) {
			fill_index = i;
			s->bufs[i].state = FM_BUF_FILLING;
			s->bufs[i].len = 0;
			return &s->bufs[i];
		}
	return NULL;
}

/* Read what the input has now; bytes read (0: none ready, or no room), or -errno. */
static ssize_t fill_from_input(struct fm_session *s, int *eof)
{
	struct fm_batch_buf *b = fill_buf(s);
	ssize_t n;

	if (!b)
		return 0;
	n = read_input(s, buf_data(s, fill_index) + b->len, s->slot_size - b->len);
	if (n < 0)
		return errno == EINTR || errno == EAGAIN ? 0 : -errno;
	if (n == 0) {
		*eof = 1;
		return 0;
	}
	if (s->stats.bytes == 0 && b->len == 0)
		fm_start_clock(s);
	/* CRC what was just read while it is still in cache, not 4 MiB later. */
	b->crc = fm_crc32c(b->len ? b->crc : 0, buf_data(s, fill_index) + b->len, (size_t)n);
	b->len += (size_t)n;
	s->stats.bytes += (uint64_t)n;
	return n;
}

static int writes_pending(struct fm_session *s)
{
	uint32_t i;

	for (i = 0; i <= s->ring.depth; i++)
		if (s->bufs[i].state == FM_BUF_WRITING)
			return 1;
	return 0;
}

/*
 * Ship the filling batch when it is full, at the end of the input, or when the
 * input has nothing more right now and fewer than two batches are in flight
 * (claimed and not yet credited).
 * QEMU writes 32 KiB at a time and the mover reads faster than that, so
 * shipping whenever the socket is momentarily empty would send batches of a
 * few KiB, each paying a write, a CRC call, two messages and a credit.
 * Waiting while two are in flight lets batches grow with the stream's rate,
 * yet the receiver always has the next one arriving while it delivers one.
 */
static int should_ship(struct fm_session *s, int eof, ssize_t got)
{
	const struct fm_batch_buf *b;

	if (fill_index < 0 || s->bufs[fill_index].len == 0)
		return 0;
	b = &s->bufs[fill_index];
	return b->len == s->slot_size || eof ||
	       (got == 0 && fm_ring_in_flight(&s->ring) < 2);
}

static int pump(struct fm_session *s)
{
	int eof = 0, ret;
	ssize_t got;

	while (!eof || fill_index >= 0 || writes_pending(s) || fm_ring_in_flight(&s->ring)) {
		ret = fm_progress(s);
		if (!ret)
			ret = fm_check_peer(s, fm_ring_in_flight(&s->ring) || writes_pending(s));
		if (ret)
			return ret;
		got = eof ? 0 : fill_from_input(s, &eof);
		if (got < 0)
			return (int)got;
		if (fill_index >= 0 && s->bufs[fill_index].len == 0 && eof) {
			s->bufs[fill_index].state = FM_BUF_FREE; /* nothing left to ship */
			fill_index = -1;
		}
		if (should_ship(s, eof, got) && fm_ring_can_send(&s->ring)) {
			ret = post_write(s, fill_index);
			if (ret)
				return ret;
			fill_index = -1;
			continue;
		}
		/* Nothing owed by the peer: silence is our input's, not the peer's. */
		if (!fm_ring_in_flight(&s->ring) && !writes_pending(s))
			s->last_progress = fm_now();
		/* tcp;ofi_rxm's wait fd announces arriving messages but not room to
		 * continue a large write, so while one is partly sent wake each ms. */
		if (got == 0) {
			ret = fm_wait(s, !eof && fill_buf(s) ? s->local_fd : -1, POLLIN,
				      writes_pending(s) ? 1 : 100);
			if (ret)
				return ret;
		}
	}
	return 0;
}

int fm_run_sender(struct fm_session *s)
{
	struct fm_msg fin = {.type = FM_MSG_FIN};
	double deadline;
	int ret;

	s->on_done = sender_done;
	s->last_progress = fm_now();
	ret = pump(s);
	if (ret)
		return ret;
	fin.seq = s->stats.bytes;
	ret = fm_send_msg(s, &fin, FM_MSG_HDR_LEN);
	deadline = fm_now() + s->cfg->timeout_s;
	while (!ret && !s->fin_received) {
		ret = fm_progress(s);
		if (!ret && fm_now() > deadline)
			ret = -ETIMEDOUT;
	}
	if (s->stats.seconds > 0)
		s->stats.seconds = fm_now() - s->stats.seconds;
	return ret;
}
