// SPDX-License-Identifier: Apache-2.0
/*
 * heartbeat: every 10 ms write "HB <counter> <guest_monotonic_ns>" to a port.
 *
 * The host stamps each line on arrival; the longest gap between consecutive
 * lines is the downtime the guest observed.  After a stall (a paused VM) the
 * schedule restarts from now instead of bursting to catch up, so a gap shows
 * as one gap.
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PERIOD_NS 10000000L

static long long ns_of(const struct timespec *t)
{
	return t->tv_sec * 1000000000LL + t->tv_nsec;
}

int main(int argc, char **argv)
{
	const char *port = argc > 1 ? argv[1] : "/dev/ttyS1";
	unsigned long long counter = 0;
	struct timespec now, next;
	char line[64];
	int fd = open(port, O_WRONLY | O_NOCTTY);

	if (fd < 0) {
		perror(port);
		return 1;
	}
	clock_gettime(CLOCK_MONOTONIC, &next);
	for (;;) {
		int len;

		clock_gettime(CLOCK_MONOTONIC, &now);
		len = snprintf(line, sizeof(line), "HB %llu %lld\n", counter++, ns_of(&now));
		if (write(fd, line, (size_t)len) < 0)
			usleep(1000);
		next.tv_nsec += PERIOD_NS;
		if (next.tv_nsec >= 1000000000L) {
			next.tv_nsec -= 1000000000L;
			next.tv_sec++;
		}
		if (ns_of(&next) < ns_of(&now))
			next = now;
		clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
	}
}
