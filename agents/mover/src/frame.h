/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_FRAME_H
#define FM_FRAME_H

#include <stddef.h>
#include <stdint.h>

/*
 * Control messages between the two movers.  Bulk bytes never travel in these:
 * they are RMA-written into the receiver's ring, and a BATCH message says
 * which slot now holds which sequence number.  REVERSE carries the small
 * return-path traffic (postcopy page requests) in its own messages, so it
 * never queues behind bulk data.
 */
#define FM_MAGIC 0x464d4d56u /* "FMMV" */
#define FM_VERSION 1
#define FM_TOKEN_LEN 64
#define FM_REVERSE_MAX 4096

enum fm_msg_type {
	FM_MSG_HELLO = 1,   /* sender -> receiver, over the bootstrap socket */
	FM_MSG_WELCOME = 2, /* receiver -> sender: ring address, key, geometry */
	FM_MSG_BATCH = 3,   /* slot k holds batch seq, len bytes, crc */
	FM_MSG_CREDIT = 4,  /* receiver consumed everything up to seq */
	FM_MSG_REVERSE = 5, /* return-path bytes, either way */
	FM_MSG_FIN = 6,	    /* sender's input ended: total bytes */
	FM_MSG_ERROR = 7,
};

struct fm_hello {
	uint32_t magic, version;
	char token[FM_TOKEN_LEN];
	uint64_t addr_len;
	uint8_t addr[128]; /* the sender's fabric address (fi_getname) */
};

struct fm_welcome {
	uint32_t magic, version;
	uint64_t ring_addr, ring_key;
	uint32_t slots, slot_size;
	uint64_t addr_len;
	uint8_t addr[128];
};

struct fm_msg {
	uint32_t type;
	uint32_t len; /* BATCH: payload bytes; REVERSE: bytes in data[] */
	uint64_t seq; /* BATCH: batch number; CREDIT: consumed up to; FIN: total bytes */
	uint32_t slot;
	uint32_t crc;
	uint8_t data[FM_REVERSE_MAX];
};

#define FM_MSG_HDR_LEN offsetof(struct fm_msg, data)

/* 0 if @msg (of @got bytes) is well formed for a ring of @slots x @slot_size, else -EPROTO. */
int fm_msg_check(const struct fm_msg *msg, size_t got, uint32_t slots, uint32_t slot_size);

/* 0 if constant-time equal over FM_TOKEN_LEN bytes. */
int fm_token_check(const char *presented, const char *expected);

/*
 * The bootstrap messages as they arrive from the socket: 0 if usable,
 * -EACCES for a wrong magic, version or credential, -EPROTO for a field out of
 * range (an address longer than its buffer, an empty ring).
 */
int fm_hello_check(const struct fm_hello *h, const char *token);
int fm_welcome_check(const struct fm_welcome *w);

#endif
