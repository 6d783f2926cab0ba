// SPDX-License-Identifier: Apache-2.0
/* What sender and receiver share: message pools, completions, liveness, stats. */
#include "session.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

double fm_now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

struct fm_msg *fm_tx_msg(struct fm_session *s, int index)
{
	return (struct fm_msg *)s->msgs_tx.buf + index;
}

struct fm_msg *fm_rx_msg(struct fm_session *s, int index)
{
	return (struct fm_msg *)s->msgs_rx.buf + index;
}

int fm_post_recv(struct fm_session *s, int index)
{
	struct fm_op *op = &s->rx_ops[index];
	ssize_t ret;

	op->kind = FM_OP_RECV;
	op->index = index;
	do {
		ret = fi_recv(s->fab.ep, fm_rx_msg(s, index), sizeof(struct fm_msg), s->msgs_rx.desc,
			      s->fab.peer, &op->ctx);
	} while (ret == -FI_EAGAIN && !fi_cq_read(s->fab.cq, NULL, 0));
	return (int)ret;
}

int fm_post_all_recvs(struct fm_session *s)
{
	int i, ret;

	for (i = 0; i < FM_MSG_POOL; i++) {
		ret = fm_post_recv(s, i);
		if (ret)
			return ret;
	}
	return 0;
}

static int free_tx_slot(struct fm_session *s)
{
	int i;

	for (i = 0; i < FM_MSG_POOL; i++)
		if (!s->tx_busy[i])
			return i;
	return -1;
}

int fm_send_msg(struct fm_session *s, const struct fm_msg *msg, size_t len)
{
	double deadline = fm_now() + s->cfg->timeout_s;
	struct fm_op *op;
	ssize_t ret;
	int i;

	while ((i = free_tx_slot(s)) < 0) {
		ret = fm_progress(s);
		if (ret)
			return (int)ret;
		if (fm_now() > deadline)
			return -ETIMEDOUT;
	}
	memcpy(fm_tx_msg(s, i), msg, len);
	op = &s->tx_ops[i];
	op->kind = FM_OP_SEND;
	op->index = i;
	s->tx_busy[i] = 1;
	while ((ret = fi_send(s->fab.ep, fm_tx_msg(s, i), len, s->msgs_tx.desc, s->fab.peer,
			      &op->ctx)) == -FI_EAGAIN) {
		int err = fm_progress(s);

		if (err)
			return err;
	}
	if (ret)
		s->tx_busy[i] = 0;
	return (int)ret;
}

static int report_cq_error(struct fm_session *s)
{
	struct fi_cq_err_entry err = {0};

	fi_cq_readerr(s->fab.cq, &err, 0);
	fprintf(stderr, "mover: fabric: completion error: %s (%s)\n", fi_strerror(err.err),
		fi_cq_strerror(s->fab.cq, err.prov_errno, err.err_data, NULL, 0));
	return -(err.err ? err.err : EIO);
}

int fm_progress(struct fm_session *s)
{
	return fm_progress_wait(s, 0);
}

int fm_progress_wait(struct fm_session *s, int timeout_ms)
{
	struct fi_cq_data_entry comp[16];
	ssize_t n, i;
	int ret;

	for (;;) {
		if (timeout_ms > 0) {
			n = fi_cq_sread(s->fab.cq, comp, 16, NULL, timeout_ms);
			timeout_ms = 0;
		} else {
			n = fi_cq_read(s->fab.cq, comp, 16);
		}
		if (n == -FI_EAGAIN)
			return 0;
		if (n == -FI_EAVAIL)
			return report_cq_error(s);
		if (n < 0)
			return (int)n;
		s->last_progress = fm_now();
		for (i = 0; i < n; i++) {
			struct fm_op *op = comp[i].op_context;

			if (op->kind == FM_OP_SEND) {
				s->tx_busy[op->index] = 0;
				continue;
			}
			ret = s->on_done(s, op, comp[i].len);
			if (ret)
				return ret;
		}
	}
}

int fm_check_peer(struct fm_session *s, int owed)
{
	struct pollfd p = {.fd = s->oob_fd, .events = POLLIN};
	char c;

	if (poll(&p, 1, 0) == 1 && recv(s->oob_fd, &c, 1, MSG_DONTWAIT) <= 0) {
		fprintf(stderr, "mover: peer vanished (its bootstrap connection closed)\n");
		return -ECONNRESET;
	}
	if (owed && fm_now() - s->last_progress > s->cfg->timeout_s) {
		fprintf(stderr, "mover: peer silent for %d s\n", s->cfg->timeout_s);
		return -ETIMEDOUT;
	}
	return 0;
}

static double cpu_seconds(const struct rusage *ru)
{
	return (double)ru->ru_utime.tv_sec + ru->ru_utime.tv_usec / 1e6 +
	       (double)ru->ru_stime.tv_sec + ru->ru_stime.tv_usec / 1e6;
}

void fm_start_clock(struct fm_session *s)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	s->stats.seconds = fm_now();
	s->stats.cpu_at_first_byte = cpu_seconds(&ru);
}

void fm_print_stats(struct fm_session *s)
{
	struct rusage ru;
	FILE *out = stderr;
	double mib = (double)s->stats.bytes / (1 << 20);

	getrusage(RUSAGE_SELF, &ru);
	if (s->cfg->stats_file) {
		out = fopen(s->cfg->stats_file, "w");
		if (!out)
			out = stderr;
	}
	fprintf(out,
		"{\"role\": \"%s\", \"provider\": \"%s\", \"bytes\": %llu, \"batches\": %llu, "
		"\"reverse_bytes\": %llu, \"seconds\": %.6f, \"mib_per_s\": %.1f, "
		"\"cpu_user_s\": %.3f, \"cpu_sys_s\": %.3f, \"batch_kib\": %u, \"depth\": %u, "
		"\"ordered\": %d, \"cpu_transfer_s\": %.3f}\n",
		s->cfg->role, s->cfg->provider, (unsigned long long)s->stats.bytes,
		(unsigned long long)s->stats.batches, (unsigned long long)s->stats.reverse_bytes,
		s->stats.seconds, s->stats.seconds > 0 ? mib / s->stats.seconds : 0.0,
		(double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6,
		(double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6, s->cfg->batch_kib,
		s->ring.depth, s->fab.ordered,
		s->stats.seconds > 0 ? cpu_seconds(&ru) - s->stats.cpu_at_first_byte : 0.0);
	if (out != stderr)
		fclose(out);
}

int fm_wait(struct fm_session *s, int fd, short events, int timeout_ms)
{
	struct fid *cq = &s->fab.cq->fid;
	struct pollfd p[3] = {
		{.fd = s->fab.cq_fd, .events = POLLIN},
		{.fd = s->oob_fd, .events = POLLIN},
		{.fd = fd, .events = events},
	};

	if (s->fab.cq_fd < 0)
		return fm_progress_wait(s, 1); /* no fd to poll: a short wait on the CQ alone */
	/* fi_trywait fails (FI_EAGAIN) while the provider has work the fd would not
	 * announce; then progressing now is the right thing to do. */
	if (fi_trywait(s->fab.fabric, &cq, 1) == FI_SUCCESS &&
	    poll(p, fd >= 0 && events ? 3 : 2, timeout_ms) < 0 && errno != EINTR)
		return -errno;
	return fm_progress(s);
}
