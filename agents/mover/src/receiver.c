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
#include <sys/socket.h>
#include <unistd.h>

#include "crc32c.h"
#include "oob.h"
#include "session.h"

/*
 * QEMU reads its migration socket 32 KiB at a time; a socket buffer the size
 * of a batch lets one send() hand over a whole batch instead of waking the
 * mover for every 200 KiB (the default wmem).  FORCE works for root (the
 * agent); otherwise the sysctl cap applies, which is only slower.
 */
static void widen_socket_buffer(int fd)
{
	int size = 4 << 20;

	if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof(size)))
		setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
}

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
	widen_socket_buffer(fd);
	s->local_fd = fd;
	return 0;
}

static int reject(struct fm_session *s, uint64_t seq, int err)
{
	struct fm_msg msg = {.type = FM_MSG_ERROR, .seq = seq};

	fm_send_msg(s, &msg, FM_MSG_HDR_LEN);
	return err;
}

/* A batch accepted from the sender: queued until all of it is delivered. */
static int queue_batch(struct fm_session *s, const struct fm_msg *msg)
{
	struct fm_delivery *d;

	if (fm_ring_accept(&s->ring, msg->seq, msg->slot) || s->queued >= FM_MAX_SLOTS) {
		fprintf(stderr, "mover: batch %llu out of sequence (expected %llu)\n",
			(unsigned long long)msg->seq, (unsigned long long)s->ring.expect_seq);
		return reject(s, msg->seq, -EPROTO);
	}
	d = &s->deliveries[(s->queue_head + s->queued++) % FM_MAX_SLOTS];
	d->seq = msg->seq;
	d->slot = msg->slot;
	d->crc = msg->crc;
	d->len = msg->len;
	d->off = 0;
	s->accepted_bytes += msg->len;
	return 0;
}

/*
 * Write queued batches to the output without blocking, so the fabric keeps
 * progressing (the next batches land in the ring, the return path flows)
 * while QEMU drains its socket.  A batch's CRC is checked before its first
 * byte goes out; its credit returns once its last byte has.
 */
static int deliver(struct fm_session *s)
{
	struct fm_msg credit = {.type = FM_MSG_CREDIT};
	struct fm_delivery *d;
	const char *slot;
	ssize_t n;
	int ret;

	while (s->queued) {
		d = &s->deliveries[s->queue_head];
		slot = (const char *)s->data.buf + (size_t)d->slot * s->slot_size;
		if (d->off == 0 && fm_crc32c(0, slot, d->len) != d->crc) {
			fprintf(stderr, "mover: batch %llu failed its CRC32C check: corrupted in "
					"transit\n",
				(unsigned long long)d->seq);
			return reject(s, d->seq, -EBADMSG);
		}
		ret = open_output(s);
		if (ret)
			return reject(s, d->seq, ret);
		n = send(s->local_fd, slot + d->off, d->len - d->off, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n < 0 && errno == ENOTSOCK)
			n = write(s->local_fd, slot + d->off, d->len - d->off);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return 0;
		if (n < 0)
			return reject(s, d->seq, -errno);
		if (s->stats.bytes == 0)
			fm_start_clock(s);
		d->off += (size_t)n;
		s->stats.bytes += (uint64_t)n;
		if (d->off < d->len)
			continue;
		s->stats.batches++;
		s->queue_head = (s->queue_head + 1) % FM_MAX_SLOTS;
		s->queued--;
		credit.seq = d->seq + 1;
		ret = fm_send_msg(s, &credit, FM_MSG_HDR_LEN);
		if (ret)
			return ret;
	}
	return 0;
}

static int receiver_done(struct fm_session *s, struct fm_op *op, size_t len)
{
	struct fm_msg *msg = fm_rx_msg(s, op->index);
	int ret = 0;

	if (op->kind != FM_OP_RECV || fm_msg_check(msg, len, s->ring.slots, s->slot_size)) {
		fprintf(stderr, "mover: malformed message from the sender\n");
		return -EPROTO;
	}
	switch (msg->type) {
	case FM_MSG_BATCH:
		ret = queue_batch(s, msg);
		break;
	case FM_MSG_FIN:
		if (msg->seq != s->accepted_bytes) {
			fprintf(stderr, "mover: truncated: the sender sent %llu bytes, %llu arrived\n",
				(unsigned long long)msg->seq, (unsigned long long)s->accepted_bytes);
			return -EPROTO;
		}
		s->fin_received = 1; /* answered once everything is delivered */
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
	struct fm_msg fin = {.type = FM_MSG_FIN};
	int ret = 0, closed = 0;
	short events;

	s->on_done = receiver_done;
	s->last_progress = fm_now();
	while (!ret && !(s->fin_received && !s->queued)) {
		ret = fm_progress(s);
		if (!ret)
			ret = deliver(s);
		if (!ret)
			ret = forward_reverse(s, &closed);
		if (!ret)
			ret = fm_check_peer(s, 0);
		if (ret || (s->fin_received && !s->queued))
			break;
		/* Only QEMU's socket is worth polling; a file is always ready. */
		events = (short)((s->queued ? POLLOUT : 0) | (closed ? 0 : POLLIN));
		ret = fm_wait(s, s->cfg->connect_unix ? s->local_fd : -1, events, 100);
	}
	if (!ret) {
		fin.seq = s->stats.bytes;
		ret = fm_send_msg(s, &fin, FM_MSG_HDR_LEN);
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
