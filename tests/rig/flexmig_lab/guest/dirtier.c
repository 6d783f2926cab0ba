// SPDX-License-Identifier: Apache-2.0
/*
 * dirtier: rewrite a working set of W MiB at R pages/s, random or sequential.
 *
 * Usage: dirtier WSS_MIB RATE_PAGES_PER_S random|seq [HOT_MIB]
 * With HOT_MIB, all W MiB are written once and only the first HOT_MIB are
 * rewritten: a VM whose memory is all in use but mostly cold (seed 003).
 * The rate is paced in 10 ms ticks; a guest too slow to keep up simply runs
 * flat out, and verify reports how many pages were really written.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "workset.h"

#define TICK_NS 10000000L

static void *map_shm(const char *path, size_t size)
{
	void *p;
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);

	if (fd < 0)
		return NULL;
	if (ftruncate(fd, (off_t)size) < 0) {
		close(fd);
		return NULL;
	}
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	return p == MAP_FAILED ? NULL : p;
}

static uint64_t rng_state = 0x2545f4914f6cdd1dULL;

static uint32_t next_random(uint32_t n)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state % n);
}

static void write_page(struct fm_meta *meta, uint64_t *ws, uint32_t index)
{
	uint32_t version = meta->versions[index] + 1;

	fm_fill_page(ws + (size_t)index * FM_WORDS_PER_PAGE, index, version);
	__atomic_store_n(&meta->versions[index], version, __ATOMIC_RELEASE);
	meta->pages_written++;
}

static void honour_pause(struct fm_meta *meta)
{
	if (!__atomic_load_n(&meta->pause_req, __ATOMIC_ACQUIRE))
		return;
	__atomic_store_n(&meta->paused, 1, __ATOMIC_RELEASE);
	while (__atomic_load_n(&meta->pause_req, __ATOMIC_ACQUIRE))
		usleep(1000);
	__atomic_store_n(&meta->paused, 0, __ATOMIC_RELEASE);
}

static void add_ns(struct timespec *t, long ns)
{
	t->tv_nsec += ns;
	while (t->tv_nsec >= 1000000000L) {
		t->tv_nsec -= 1000000000L;
		t->tv_sec++;
	}
}

int main(int argc, char **argv)
{
	char ws_path[256], meta_path[256];
	struct fm_meta *meta;
	struct timespec next;
	uint64_t *ws;
	uint32_t npages, nhot, cursor = 0, i;
	long rate;
	double owed = 0;
	int random_order;

	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: dirtier WSS_MIB RATE random|seq [HOT_MIB]\n");
		return 2;
	}
	npages = (uint32_t)(strtoul(argv[1], NULL, 10) * (1024 * 1024 / FM_PAGE_SIZE));
	rate = strtol(argv[2], NULL, 10);
	random_order = strcmp(argv[3], "seq") != 0;
	nhot = argc == 5 ? (uint32_t)(strtoul(argv[4], NULL, 10) * (1024 * 1024 / FM_PAGE_SIZE))
			 : npages;
	if (npages == 0 || rate < 0 || nhot == 0 || nhot > npages) {
		fprintf(stderr, "dirtier: bad working set or rate\n");
		return 2;
	}
	fm_workset_paths(ws_path, meta_path, sizeof(ws_path));
	meta = map_shm(meta_path, fm_meta_size(npages));
	ws = map_shm(ws_path, (size_t)npages * FM_PAGE_SIZE);
	if (!meta || !ws) {
		fprintf(stderr, "dirtier: cannot map working set: %s\n", strerror(errno));
		return 1;
	}
	meta->npages = npages;
	meta->writer_pid = (uint32_t)getpid();
	for (i = 0; i < npages; i++)
		write_page(meta, ws, i);
	meta->magic = FM_META_MAGIC;
	__atomic_store_n(&meta->ready, 1, __ATOMIC_RELEASE);
	printf("dirtier: %u pages ready, %u hot, rate %ld pages/s, %s\n", npages, nhot, rate,
	       argv[3]);
	fflush(stdout);

	clock_gettime(CLOCK_MONOTONIC, &next);
	for (;;) {
		honour_pause(meta);
		owed += (double)rate * TICK_NS / 1e9;
		for (; owed >= 1; owed--) {
			uint32_t index = random_order ? next_random(nhot) : cursor++ % nhot;

			write_page(meta, ws, index);
		}
		add_ns(&next, TICK_NS);
		clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
	}
}
