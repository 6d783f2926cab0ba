// SPDX-License-Identifier: Apache-2.0
#include "oob.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int wait_fd(int fd, short events, int timeout_ms)
{
	struct pollfd p = {.fd = fd, .events = events};
	int ret = poll(&p, 1, timeout_ms);

	if (ret < 0)
		return -errno;
	return ret == 0 ? -ETIMEDOUT : 0;
}

static int inet_addr_of(const char *addr, int port, struct sockaddr_in *sa)
{
	memset(sa, 0, sizeof(*sa));
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)port);
	return inet_pton(AF_INET, addr, &sa->sin_addr) == 1 ? 0 : -EINVAL;
}

static int accept_one(int lfd, int timeout_ms)
{
	int fd, ret = wait_fd(lfd, POLLIN, timeout_ms);

	if (ret)
		return ret;
	fd = accept(lfd, NULL, NULL);
	return fd < 0 ? -errno : fd;
}

int fm_oob_listen_accept(const char *addr, int port, int timeout_ms)
{
	struct sockaddr_in sa;
	int one = 1, lfd, fd;

	if (inet_addr_of(addr, port, &sa))
		return -EINVAL;
	lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (lfd < 0)
		return -errno;
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 1)) {
		fd = -errno;
		goto out;
	}
	fd = accept_one(lfd, timeout_ms);
out:
	close(lfd);
	if (fd >= 0)
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	return fd;
}

int fm_oob_connect(const char *addr, int port, int timeout_ms)
{
	struct sockaddr_in sa;
	int fd, one = 1, waited = 0;

	if (inet_addr_of(addr, port, &sa))
		return -EINVAL;
	for (;;) {
		fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		if (!connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
			break;
		close(fd);
		/* The receiver may still be starting: retry refusals, bounded. */
		if (errno != ECONNREFUSED || waited >= timeout_ms)
			return errno == ECONNREFUSED ? -ETIMEDOUT : -errno;
		usleep(50000);
		waited += 50;
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	return fd;
}

int fm_write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;

	while (len) {
		ssize_t n = write(fd, p, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN) {
			wait_fd(fd, POLLOUT, 100);
			continue;
		}
		if (n <= 0)
			return n < 0 ? -errno : -EPIPE;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

int fm_oob_recv_all(int fd, void *buf, size_t len, int timeout_ms)
{
	char *p = buf;
	int ret;

	while (len) {
		ssize_t n;

		ret = wait_fd(fd, POLLIN, timeout_ms);
		if (ret)
			return ret;
		n = recv(fd, p, len, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -ECONNRESET;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

static int unix_addr(const char *path, struct sockaddr_un *sa)
{
	memset(sa, 0, sizeof(*sa));
	sa->sun_family = AF_UNIX;
	if (strlen(path) >= sizeof(sa->sun_path))
		return -ENAMETOOLONG;
	strcpy(sa->sun_path, path);
	return 0;
}

int fm_unix_listen_accept(const char *path, int timeout_ms)
{
	struct sockaddr_un sa;
	int lfd, fd;

	if (unix_addr(path, &sa))
		return -ENAMETOOLONG;
	lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (lfd < 0)
		return -errno;
	unlink(path);
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 1)) {
		fd = -errno;
		goto out;
	}
	fd = accept_one(lfd, timeout_ms);
out:
	close(lfd);
	unlink(path);
	return fd;
}

int fm_unix_accept_fd(int lfd, int timeout_ms)
{
	/* Several movers block on the same listening socket; the kernel hands
	 * each connection to one of them.  Another may win the race after poll. */
	int fd, ret, flags = fcntl(lfd, F_GETFL);

	if (flags < 0 || fcntl(lfd, F_SETFL, flags | O_NONBLOCK))
		return -errno;
	for (;;) {
		ret = wait_fd(lfd, POLLIN, timeout_ms);
		if (ret)
			return ret;
		fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
		if (fd >= 0)
			break;
		if (errno != EAGAIN && errno != EINTR)
			return -errno;
	}
	/* The accepted socket inherits nothing from O_NONBLOCK on Linux. */
	close(lfd);
	return fd;
}

int fm_unix_connect_retry(const char *path, int timeout_ms)
{
	struct sockaddr_un sa;
	int fd, waited = 0;

	if (unix_addr(path, &sa))
		return -ENAMETOOLONG;
	for (;;) {
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		if (!connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
			return fd;
		close(fd);
		if ((errno != ENOENT && errno != ECONNREFUSED) || waited >= timeout_ms)
			return waited >= timeout_ms ? -ETIMEDOUT : -errno;
		usleep(20000);
		waited += 20;
	}
}
