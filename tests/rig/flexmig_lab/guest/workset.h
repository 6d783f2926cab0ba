/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The guest's working set, shared by dirtier and verify through /dev/shm.
 *
 * Every page's content is a pure function of (page index, version), so a
 * verifier can tell a correct page from a stale, corrupted or never-sent one
 * (a page that arrived as zeros) without keeping a copy.
 */
#ifndef FM_WORKSET_H
#define FM_WORKSET_H

#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#define FM_PAGE_SIZE 4096u
#define FM_WORDS_PER_PAGE (FM_PAGE_SIZE / sizeof(uint64_t))
#define FM_META_MAGIC 0x464d5753u /* "FMWS" */
#define FM_WORKSET_DIR "/dev/shm"

struct fm_meta {
	uint32_t magic;
	uint32_t npages;
	volatile uint32_t ready;	 /* initial fill done */
	volatile uint32_t pause_req;	 /* set by verify */
	volatile uint32_t paused;	 /* acknowledged by dirtier */
	uint32_t writer_pid;	 /* the dirtier, so verify need not wait for a dead one */
	volatile uint64_t pages_written; /* including the initial fill */
	uint32_t versions[];		 /* current version of each page */
};

static inline uint64_t fm_mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return x;
}

static inline uint64_t fm_page_base(uint32_t index, uint32_t version)
{
	/* Never zero, so an all-zero page is always "lost", never "correct". */
	return fm_mix64(((uint64_t)index << 32) | version) | 1;
}

/* Word k is base + k * golden: one add per word keeps dirtying cheap under TCG. */
static inline void fm_fill_page(uint64_t *page, uint32_t index, uint32_t version)
{
	uint64_t w = fm_page_base(index, version);
	size_t k;

	for (k = 0; k < FM_WORDS_PER_PAGE; k++, w += 0x9e3779b97f4a7c15ULL)
		page[k] = w;
}

enum fm_page_state { FM_PAGE_OK, FM_PAGE_BAD, FM_PAGE_LOST };

static inline enum fm_page_state fm_check_page(const uint64_t *page, uint32_t index,
					       uint32_t version)
{
	uint64_t w = fm_page_base(index, version), any = 0;
	int bad = 0;
	size_t k;

	for (k = 0; k < FM_WORDS_PER_PAGE; k++, w += 0x9e3779b97f4a7c15ULL) {
		any |= page[k];
		bad |= page[k] != w;
	}
	if (!bad)
		return FM_PAGE_OK;
	return any ? FM_PAGE_BAD : FM_PAGE_LOST;
}

/* FM_WORKSET_DIR in the environment moves the files (host-side tests). */
static inline void fm_workset_paths(char *ws, char *meta, size_t len)
{
	const char *dir = getenv("FM_WORKSET_DIR");

	if (!dir || !*dir)
		dir = FM_WORKSET_DIR;
	snprintf(ws, len, "%s/fm-workset", dir);
	snprintf(meta, len, "%s/fm-workset.meta", dir);
}

static inline size_t fm_meta_size(uint32_t npages)
{
	return sizeof(struct fm_meta) + (size_t)npages * sizeof(uint32_t);
}

#endif
