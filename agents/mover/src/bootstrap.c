// SPDX-License-Identifier: Apache-2.0
/*
 * Bootstrap: over one TCP connection on the management network the sender
 * presents the migration's credential and its fabric address; the receiver
 * checks the credential before it registers anything or learns the sender's
 * address, then answers with its ring (address, key, geometry) and its own
 * fabric address.  Nothing moves over the fabric before that.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "oob.h"
#include "session.h"

#define ACCEPT_TIMEOUT_FACTOR 6

static void keepalive(int fd, int timeout_s)
{
	int on = 1, idle = timeout_s, intvl = 1, cnt = 3;

	/* A cut link (no FIN, no RST) still ends the line within timeout + 3 s. */
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

static int alloc_msgs(struct fm_session *s)
{
	size_t len = FM_MSG_POOL * sizeof(struct fm_msg);
	int ret = fm_region_alloc(&s->fab, &s->msgs_tx, len, FI_SEND);

	if (!ret)
		ret = fm_region_alloc(&s->fab, &s->msgs_rx, len, FI_RECV);
	return ret;
}

static int open_file(const char *path, int out)
{
	int fd;

	if (!strcmp(path, "-"))
		return out ? dup(STDOUT_FILENO) : dup(STDIN_FILENO);
	fd = out ? open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)
		 : open(path, O_RDONLY | O_CLOEXEC);
	return fd < 0 ? -errno : fd;
}

/* Everything but QEMU's connection is in place: fabric, ring, credential. */
static int mark_ready(const char *path)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	if (fd < 0) {
		fprintf(stderr, "mover: creating %s: %s\n", path, strerror(errno));
		return -errno;
	}
	close(fd);
	return 0;
}

static int sender_bootstrap(struct fm_session *s, const char *token)
{
	struct fm_config *c = s->cfg;
	struct fm_hello hello = {.magic = FM_MAGIC, .version = FM_VERSION};
	struct fm_welcome w;
	int ret;

	memcpy(hello.token, token, FM_TOKEN_LEN);
	hello.addr_len = s->fab.addr_len;
	memcpy(hello.addr, s->fab.addr, s->fab.addr_len);
	s->oob_fd = fm_oob_connect(c->peer, c->port, c->timeout_s * 1000);
	if (s->oob_fd < 0)
		return s->oob_fd;
	ret = fm_write_all(s->oob_fd, &hello, sizeof(hello));
	if (!ret)
		ret = fm_oob_recv_all(s->oob_fd, &w, sizeof(w), c->timeout_s * 1000);
	if (ret)
		return ret;
	ret = fm_welcome_check(&w);
	if (ret == -EACCES)
		fprintf(stderr, "mover: the receiver refused our credential\n");
	if (ret)
		return ret;
	s->ring_addr = w.ring_addr;
	s->ring_key = w.ring_key;
	s->slot_size = w.slot_size;
	ret = fm_fabric_set_peer(&s->fab, w.addr, w.addr_len);
	if (!ret)
		ret = fm_ring_init(&s->ring, w.slots, c->depth);
	if (!ret)
		ret = alloc_msgs(s);
	if (!ret)
		ret = fm_region_alloc(&s->fab, &s->data, (size_t)(s->ring.depth + 1) * s->slot_size,
				      FI_WRITE);
	if (!ret)
		ret = fm_post_all_recvs(s);
	if (!ret && c->ready_file)
		ret = mark_ready(c->ready_file);
	if (ret)
		return ret;
	if (c->input)
		s->local_fd = open_file(c->input, 0);
	else if (c->listen_unix)
		s->local_fd = fm_unix_listen_accept(c->listen_unix,
						    c->timeout_s * 1000 * ACCEPT_TIMEOUT_FACTOR);
	else
		s->local_fd = fm_unix_accept_fd(c->listen_fd,
						c->timeout_s * 1000 * ACCEPT_TIMEOUT_FACTOR);
	s->input_is_socket = 1; /* until recv() says ENOTSOCK */
	return s->local_fd < 0 ? s->local_fd : 0;
}

static int receiver_bootstrap(struct fm_session *s, const char *token)
{
	struct fm_config *c = s->cfg;
	struct fm_welcome w = {0};
	struct fm_hello h;
	int ret;

	s->oob_fd = fm_oob_listen_accept(c->local, c->port,
					 c->timeout_s * 1000 * ACCEPT_TIMEOUT_FACTOR);
	if (s->oob_fd < 0)
		return s->oob_fd;
	ret = fm_oob_recv_all(s->oob_fd, &h, sizeof(h), c->timeout_s * 1000);
	if (ret)
		return ret;
	ret = fm_hello_check(&h, token);
	if (ret) {
		fm_write_all(s->oob_fd, &w, sizeof(w)); /* magic 0: refused */
		if (ret == -EACCES)
			fprintf(stderr, "mover: the peer presented a wrong or no credential\n");
		return ret;
	}
	s->slot_size = c->batch_kib * 1024;
	ret = fm_fabric_set_peer(&s->fab, h.addr, h.addr_len);
	if (!ret)
		ret = fm_ring_init(&s->ring, c->slots, c->slots);
	if (!ret)
		ret = alloc_msgs(s);
	if (!ret)
		ret = fm_region_alloc(&s->fab, &s->data, (size_t)c->slots * s->slot_size,
				      FI_REMOTE_WRITE);
	if (!ret)
		ret = fm_post_all_recvs(s);
	if (ret)
		return ret;
	w.magic = FM_MAGIC;
	w.version = FM_VERSION;
	w.ring_addr = fm_region_remote_addr(&s->fab, &s->data, 0);
	w.ring_key = s->data.key;
	w.slots = c->slots;
	w.slot_size = s->slot_size;
	w.addr_len = s->fab.addr_len;
	memcpy(w.addr, s->fab.addr, s->fab.addr_len);
	ret = fm_write_all(s->oob_fd, &w, sizeof(w));
	if (!ret && c->output) {
		s->local_fd = open_file(c->output, 1);
		ret = s->local_fd < 0 ? s->local_fd : 0;
	}
	return ret;
}

int fm_bootstrap(struct fm_session *s, const char *token)
{
	int ret = fm_fabric_open(&s->fab, s->cfg->provider, s->cfg->local);

	if (ret)
		return ret;
	ret = strcmp(s->cfg->role, "send") ? receiver_bootstrap(s, token)
					   : sender_bootstrap(s, token);
	if (s->oob_fd >= 0)
		keepalive(s->oob_fd, s->cfg->timeout_s);
	return ret;
}
