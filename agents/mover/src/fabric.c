// SPDX-License-Identifier: Apache-2.0
#include "fabric.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FM_FI_VERSION FI_VERSION(1, 9)
#define CQ_SIZE 1024

static struct fi_info *make_hints(const char *provider, int ordered)
{
	struct fi_info *hints = fi_allocinfo();

	if (!hints)
		return NULL;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_DIRECTED_RECV;
	hints->mode = FI_CONTEXT;
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
				      FI_MR_PROV_KEY | FI_MR_ENDPOINT;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	if (ordered)
		hints->tx_attr->msg_order = FI_ORDER_SAW;
	hints->fabric_attr->prov_name = strdup(provider);
	return hints;
}

static int get_info(struct fm_fabric *f, const char *provider, const char *node)
{
	struct fi_info *hints;
	int ret, ordered;

	for (ordered = 1; ordered >= 0; ordered--) {
		hints = make_hints(provider, ordered);
		if (!hints)
			return -ENOMEM;
		ret = fi_getinfo(FM_FI_VERSION, node, NULL, FI_SOURCE, hints, &f->info);
		fi_freeinfo(hints);
		if (!ret) {
			f->ordered = ordered;
			return 0;
		}
	}
	fprintf(stderr, "mover: fabric: no provider %s on %s: %s\n", provider, node,
		fi_strerror(-ret));
	return ret;
}

int fm_fabric_open(struct fm_fabric *f, const char *provider, const char *node)
{
	/* A CQ with a wait fd: an idle mover sleeps in poll() on it together with
	 * its QEMU socket, so it wakes for whichever is ready first instead of
	 * spinning (stealing the guest's core) or sleeping blind on one of them. */
	struct fi_cq_attr cq_attr = {
		.format = FI_CQ_FORMAT_DATA, .size = CQ_SIZE, .wait_obj = FI_WAIT_FD};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	const char *step;
	int ret;

	memset(f, 0, sizeof(*f));
	f->cq_fd = -1;
	ret = get_info(f, provider, node);
	if (ret)
		return ret;
	step = "fi_fabric";
	ret = fi_fabric(f->info->fabric_attr, &f->fabric, NULL);
	if (ret)
		goto err;
	step = "fi_domain";
	ret = fi_domain(f->fabric, f->info, &f->domain, NULL);
	if (ret)
		goto err;
	step = "fi_cq_open";
	ret = fi_cq_open(f->domain, &cq_attr, &f->cq, NULL);
	if (ret == -FI_ENOSYS) {
		/* No fd to poll: fall back to fi_cq_sread's own wait. */
		cq_attr.wait_obj = FI_WAIT_UNSPEC;
		ret = fi_cq_open(f->domain, &cq_attr, &f->cq, NULL);
	}
	if (ret)
		goto err;
	if (cq_attr.wait_obj != FI_WAIT_FD || fi_control(&f->cq->fid, FI_GETWAIT, &f->cq_fd))
		f->cq_fd = -1;
	step = "fi_av_open";
	ret = fi_av_open(f->domain, &av_attr, &f->av, NULL);
	if (ret)
		goto err;
	step = "fi_endpoint";
	ret = fi_endpoint(f->domain, f->info, &f->ep, NULL);
	if (ret)
		goto err;
	step = "fi_ep_bind";
	ret = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV);
	if (!ret)
		ret = fi_ep_bind(f->ep, &f->av->fid, 0);
	if (ret)
		goto err;
	step = "fi_enable";
	ret = fi_enable(f->ep);
	if (ret)
		goto err;
	step = "fi_getname";
	f->addr_len = sizeof(f->addr);
	ret = fi_getname(&f->ep->fid, f->addr, &f->addr_len);
	if (ret)
		goto err;
	return 0;
err:
	fprintf(stderr, "mover: fabric: %s: %s\n", step, fi_strerror(-ret));
	fm_fabric_close(f);
	return ret;
}

void fm_fabric_close(struct fm_fabric *f)
{
	if (f->ep)
		fi_close(&f->ep->fid);
	if (f->av)
		fi_close(&f->av->fid);
	if (f->cq)
		fi_close(&f->cq->fid);
	if (f->domain)
		fi_close(&f->domain->fid);
	if (f->fabric)
		fi_close(&f->fabric->fid);
	if (f->info)
		fi_freeinfo(f->info);
	memset(f, 0, sizeof(*f));
}

int fm_fabric_set_peer(struct fm_fabric *f, const void *addr, size_t len)
{
	int ret;

	if (len == 0 || len > sizeof(f->addr))
		return -EINVAL;
	ret = fi_av_insert(f->av, addr, 1, &f->peer, 0, NULL);
	return ret == 1 ? 0 : -EINVAL;
}

int fm_region_alloc(struct fm_fabric *f, struct fm_region *r, size_t len, uint64_t access)
{
	int ret;

	memset(r, 0, sizeof(*r));
	if (posix_memalign(&r->buf, 4096, len))
		return -ENOMEM;
	memset(r->buf, 0, len);
	r->len = len;
	/* Providers that do not pick keys need a distinct one per region. */
	ret = fi_mr_reg(f->domain, r->buf, len, access, 0, ++f->next_key, 0, &r->mr, NULL);
	if (ret)
		goto err;
	if (f->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
		ret = fi_mr_bind(r->mr, &f->ep->fid, 0);
		if (!ret)
			ret = fi_mr_enable(r->mr);
		if (ret)
			goto err;
	}
	r->desc = fi_mr_desc(r->mr);
	r->key = fi_mr_key(r->mr);
	return 0;
err:
	fprintf(stderr, "mover: fabric: registering %zu bytes: %s\n", len, fi_strerror(-ret));
	fm_region_free(r);
	return ret;
}

void fm_region_free(struct fm_region *r)
{
	if (r->mr)
		fi_close(&r->mr->fid);
	free(r->buf);
	memset(r, 0, sizeof(*r));
}

uint64_t fm_region_remote_addr(const struct fm_fabric *f, const struct fm_region *r, size_t off)
{
	if (f->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR)
		return (uint64_t)(uintptr_t)r->buf + off;
	return off;
}
