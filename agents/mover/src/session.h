/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_SESSION_H
#define FM_SESSION_H

#include <stdint.h>
#include <sys/types.h>

#include "fabric.h"
#include "oob.h"
#include "frame.h"
#include "ring.h"

#define FM_MSG_POOL 64
#define FM_MAX_DEPTH 32
#define FM_MAX_SLOTS 256

struct fm_config {
	const char *role; /* "send" or "recv" */
	const char *provider;
	const char *local;
	const char *peer;
	int port;
	uint32_t batch_kib;
	uint32_t depth;
	uint32_t slots;
	const char *token;
	const char *input;	  /* send: file or "-" */
	const char *listen_unix;  /* send: QEMU connects here */
	int listen_fd;		  /* send: or accept QEMU on this inherited listening socket */
	const char *output;	  /* recv: file or "-" */
	const char *connect_unix; /* recv: QEMU listens here */
	int timeout_s;
	int64_t inject_corruption; /* batch to corrupt after its CRC (tests), or -1 */
	const char *stats_file;
	const char *ready_file; /* send: created once bootstrapped */
};

enum fm_op_kind { FM_OP_RECV, FM_OP_SEND, FM_OP_WRITE };

/* A libfabric operation context; fi_context first, as FI_CONTEXT mode asks. */
struct fm_op {
	struct fi_context ctx;
	enum fm_op_kind kind;
	int index;
};

enum fm_buf_state { FM_BUF_FREE, FM_BUF_FILLING, FM_BUF_WRITING };

struct fm_batch_buf {
	enum fm_buf_state state;
	size_t len;
	uint64_t seq;
	uint32_t slot, crc;
	struct fm_op op;
};

/* Receiver: a verified-in-sequence batch on its way to the output. */
struct fm_delivery {
	uint64_t seq;
	uint32_t slot, crc;
	size_t len, off;
};

struct fm_stats {
	uint64_t bytes, batches, reverse_bytes;
	double seconds, wait_credit_seconds;
	double cpu_at_first_byte; /* user+sys: what setup cost is apart from the transfer's */
};

struct fm_session {
	struct fm_config *cfg;
	struct fm_fabric fab;
	struct fm_ring ring;
	struct fm_region msgs_tx, msgs_rx, data; /* data: sender's buffers or receiver's ring */
	struct fm_op tx_ops[FM_MSG_POOL], rx_ops[FM_MSG_POOL];
	int tx_busy[FM_MSG_POOL];
	struct fm_batch_buf bufs[FM_MAX_DEPTH];
	uint64_t ring_addr, ring_key;
	uint32_t slot_size;
	int oob_fd, local_fd;
	int input_is_socket; /* sender: local_fd is a socket (non-blocking reads) */
	int fin_received;
	struct fm_delivery deliveries[FM_MAX_SLOTS]; /* receiver: FIFO of batches to deliver */
	uint32_t queue_head, queued;
	uint64_t accepted_bytes;
	uint64_t fin_bytes;
	double last_progress;
	struct fm_stats stats;
	/* The role's handler for receive and write completions. */
	int (*on_done)(struct fm_session *s, struct fm_op *op, size_t len);
};

double fm_now(void);
struct fm_msg *fm_tx_msg(struct fm_session *s, int index);
struct fm_msg *fm_rx_msg(struct fm_session *s, int index);
int fm_post_recv(struct fm_session *s, int index);
int fm_post_all_recvs(struct fm_session *s);
/* Send a control message of @len bytes (header + data); 0 or -errno. */
int fm_send_msg(struct fm_session *s, const struct fm_msg *msg, size_t len);
/* Read completions, handing each to s->on_done; 0 or -errno (fabric error, peer gone). */
int fm_progress(struct fm_session *s);
/* Same, first blocking up to @timeout_ms for a completion. */
int fm_progress_wait(struct fm_session *s, int timeout_ms);
/* -ECONNRESET once the peer's bootstrap line is gone; with @owed (the peer owes
 * us a completion) also -ETIMEDOUT after timeout_s of silence. */
int fm_check_peer(struct fm_session *s, int owed);
/* Nothing to do: sleep until the fabric, the bootstrap line or @fd (for @events;
 * fd < 0: none) is ready, at most @timeout_ms, then progress.  0 or -errno. */
int fm_wait(struct fm_session *s, int fd, short events, int timeout_ms);
/* The first byte moves: start the clock and note the CPU spent so far (setup). */
void fm_start_clock(struct fm_session *s);
void fm_print_stats(struct fm_session *s);

int fm_run_sender(struct fm_session *s);
int fm_run_receiver(struct fm_session *s);

#endif
