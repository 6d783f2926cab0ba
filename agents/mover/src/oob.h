/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_OOB_H
#define FM_OOB_H

#include <stddef.h>

/*
 * The bootstrap socket: TCP on the management address, used once to exchange
 * the credential and fabric addresses, then kept open as a liveness line —
 * its EOF is how a mover learns within a moment that its peer vanished.
 */
int fm_oob_listen_accept(const char *addr, int port, int timeout_ms);
int fm_oob_connect(const char *addr, int port, int timeout_ms);
/* Write all of @buf (sockets too: SIGPIPE is ignored, EPIPE comes back). */
int fm_write_all(int fd, const void *buf, size_t len);
int fm_oob_recv_all(int fd, void *buf, size_t len, int timeout_ms);
/* The unix socket side: accept QEMU (sender) or connect to QEMU (receiver). */
int fm_unix_listen_accept(const char *path, int timeout_ms);
/* Accept one connection on an inherited listening socket @lfd (then closed). */
int fm_unix_accept_fd(int lfd, int timeout_ms);
int fm_unix_connect_retry(const char *path, int timeout_ms);

#endif
