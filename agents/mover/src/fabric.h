/* SPDX-License-Identifier: Apache-2.0 */
#ifndef FM_FABRIC_H
#define FM_FABRIC_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stddef.h>
#include <stdint.h>

/*
 * One reliable-datagram endpoint with its CQ and AV: the same code for every
 * provider ("verbs;ofi_rxm" on RDMA NICs through rdma-core, "tcp;ofi_rxm"
 * elsewhere); only the provider name changes.
 */
struct fm_fabric {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep;
	fi_addr_t peer;
	int ordered; /* provider keeps a send behind an earlier write (FI_ORDER_SAW) */
	int cq_fd;   /* the CQ's wait fd (FI_WAIT_FD) to poll with other fds, or -1 */
	uint64_t next_key;
	uint8_t addr[128];
	size_t addr_len;
};

struct fm_region {
	struct fid_mr *mr;
	void *buf;
	size_t len;
	void *desc;
	uint64_t key;
};

/* Open an endpoint bound to @node (an address of this host); 0 or -errno. */
int fm_fabric_open(struct fm_fabric *f, const char *provider, const char *node);
void fm_fabric_close(struct fm_fabric *f);
int fm_fabric_set_peer(struct fm_fabric *f, const void *addr, size_t len);
/* Register @len bytes at a page-aligned fresh buffer; @access e.g. FI_REMOTE_WRITE. */
int fm_region_alloc(struct fm_fabric *f, struct fm_region *r, size_t len, uint64_t access);
void fm_region_free(struct fm_region *r);
/* The remote address a peer writes to for offset @off of region @r. */
uint64_t fm_region_remote_addr(const struct fm_fabric *f, const struct fm_region *r, size_t off);

#endif
