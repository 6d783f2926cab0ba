// SPDX-License-Identifier: GPL-2.0
/*
 * FlexMig XDP eSwitch: the fast path a NIC's eSwitch would be.
 *
 * Attached to br-int's member ports (VM taps, endpoint veths, the uplink).
 * A packet whose (ingress port, IPv4 5-tuple) is in the flow table is
 * counted and redirected straight to its egress port: OVS never sees it.
 * Everything else (ARP, IPv6, VLAN-tagged, fragments, IP options we cannot
 * bound, unknown flows) returns XDP_PASS and reaches OVS's netdev datapath
 * through the port's AF_PACKET socket, as if the fast path were not there.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "eswitch.h"

/* max_entries is a default: the loader sets the configured capacity. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, ESWITCH_DEFAULT_CAPACITY);
	__type(key, struct eswitch_flow_key);
	__type(value, struct eswitch_flow_action);
} flows SEC(".maps");

/* Ports of the fast path, keyed by ifindex; redirect targets. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, ESWITCH_MAX_PORTS);
	__type(key, __u32);
	__type(value, __u32);
} tx_ports SEC(".maps");

struct cursor {
	void *pos;
	void *end;
};

static __always_inline int parse_eth(struct cursor *c, __u16 *proto)
{
	struct ethhdr *eth = c->pos;

	if ((void *)(eth + 1) > c->end)
		return -1;
	c->pos = eth + 1;
	*proto = eth->h_proto;
	return 0;
}

/* Only unfragmented IPv4 carries ports in every packet of a flow. */
static __always_inline int parse_ipv4(struct cursor *c, struct eswitch_flow_key *key)
{
	struct iphdr *ip = c->pos;
	__u32 hdr_len;

	if ((void *)(ip + 1) > c->end)
		return -1;
	hdr_len = ip->ihl * 4;
	if (hdr_len < sizeof(*ip) || c->pos + hdr_len > c->end)
		return -1;
	if (ip->frag_off & bpf_htons(0x3fff)) /* MF or an offset */
		return -1;
	key->proto = ip->protocol;
	key->saddr = ip->saddr;
	key->daddr = ip->daddr;
	c->pos += hdr_len;
	return 0;
}

/* TCP and UDP both start with source and destination port. */
static __always_inline int parse_ports(struct cursor *c, struct eswitch_flow_key *key)
{
	struct udphdr *l4 = c->pos;

	if (key->proto != IPPROTO_TCP && key->proto != IPPROTO_UDP)
		return -1;
	if ((void *)(l4 + 1) > c->end)
		return -1;
	key->sport = l4->source;
	key->dport = l4->dest;
	return 0;
}

SEC("xdp")
int eswitch(struct xdp_md *ctx)
{
	struct cursor c = {
		.pos = (void *)(long)ctx->data,
		.end = (void *)(long)ctx->data_end,
	};
	struct eswitch_flow_key key = { .in_ifindex = ctx->ingress_ifindex };
	struct eswitch_flow_action *action;
	__u16 eth_proto;
	long verdict;

	if (parse_eth(&c, &eth_proto) || eth_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	if (parse_ipv4(&c, &key) || parse_ports(&c, &key))
		return XDP_PASS;
	action = bpf_map_lookup_elem(&flows, &key);
	if (!action)
		return XDP_PASS;
	/* A port missing from tx_ports falls back to OVS rather than a drop. */
	verdict = bpf_redirect_map(&tx_ports, action->out_ifindex, XDP_PASS);
	if (verdict == XDP_REDIRECT) {
		action->packets++;
		action->bytes += ctx->data_end - ctx->data;
	}
	return verdict;
}

char LICENSE[] SEC("license") = "GPL";
