// SPDX-License-Identifier: Apache-2.0
/*
 * verify: check every page of the working set against (index, version).
 *
 * Pauses the dirtier at a page boundary first, so no page is caught half
 * written.  Prints one line:
 *   VERIFY pages=N ok=N bad=N lost=N written=N ms=N
 * and exits 0 when every page is correct, 1 when any is bad or lost,
 * 2 when there is no working set to check.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "workset.h"

#define PAUSE_TIMEOUT_MS 5000

static void *map_existing(const char *path, size_t *size)
{
	struct stat st;
	void *p;
	int fd = open(path, O_RDWR);

	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) < 0 || st.st_size == 0) {
		close(fd);
		return NULL;
	}
	p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	*size = (size_t)st.st_size;
	return p == MAP_FAILED ? NULL : p;
}

static long now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

static int pause_dirtier(struct fm_meta *meta)
{
	long deadline = now_ms() + PAUSE_TIMEOUT_MS;

	__atomic_store_n(&meta->pause_req, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&meta->paused, __ATOMIC_ACQUIRE)) {
		/* A dead dirtier leaves stable pages: nothing to wait for. */
		if (kill((pid_t)meta->writer_pid, 0) < 0)
			return 0;
		if (now_ms() > deadline)
			return -ETIMEDOUT;
		usleep(1000);
	}
	return 0;
}

int main(void)
{
	char ws_path[256], meta_path[256];
	size_t meta_size = 0, ws_size = 0;
	struct fm_meta *meta;
	uint64_t *ws;
	uint32_t i, ok = 0, bad = 0, lost = 0;
	long start = now_ms();

	fm_workset_paths(ws_path, meta_path, sizeof(ws_path));
	meta = map_existing(meta_path, &meta_size);
	ws = map_existing(ws_path, &ws_size);
	if (!meta || !ws || meta_size < sizeof(*meta) || meta->magic != FM_META_MAGIC ||
	    !meta->ready || meta_size < fm_meta_size(meta->npages) ||
	    ws_size < (size_t)meta->npages * FM_PAGE_SIZE) {
		printf("VERIFY error=no-workset\n");
		return 2;
	}
	if (pause_dirtier(meta) < 0) {
		__atomic_store_n(&meta->pause_req, 0, __ATOMIC_RELEASE);
		printf("VERIFY error=dirtier-did-not-pause\n");
		return 2;
	}
	for (i = 0; i < meta->npages; i++) {
		uint32_t version = __atomic_load_n(&meta->versions[i], __ATOMIC_ACQUIRE);

		switch (fm_check_page(ws + (size_t)i * FM_WORDS_PER_PAGE, i, version)) {
		case FM_PAGE_OK:
			ok++;
			break;
		case FM_PAGE_BAD:
			bad++;
			break;
		case FM_PAGE_LOST:
			lost++;
			break;
		}
	}
	__atomic_store_n(&meta->pause_req, 0, __ATOMIC_RELEASE);
	printf("VERIFY pages=%u ok=%u bad=%u lost=%u written=%llu ms=%ld\n", meta->npages, ok,
	       bad, lost, (unsigned long long)meta->pages_written, now_ms() - start);
	return bad || lost ? 1 : 0;
}
