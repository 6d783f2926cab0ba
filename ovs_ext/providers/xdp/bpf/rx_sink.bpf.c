// SPDX-License-Identifier: GPL-2.0
/*
 * A packet sink for the datapath benchmark: counts and drops the IPv4/UDP
 * frames to port SINK_PORT that reach an endpoint's interface, passes the
 * rest.  It measures what a switch path delivers to a port without the cost
 * of a receiving socket, which on a 2-core machine would be the bottleneck
 * of a fast path and hide it.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#define SINK_PORT 9000

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sink_count SEC(".maps");

SEC("xdp")
int rx_sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(ip + 1);
	__u32 zero = 0;
	__u64 *count;

	/* Option-less IPv4 only: the benchmark's frames have no options. */
	if ((void *)(udp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 ||
	    ip->protocol != IPPROTO_UDP || udp->dest != bpf_htons(SINK_PORT))
		return XDP_PASS;
	count = bpf_map_lookup_elem(&sink_count, &zero);
	if (count)
		(*count)++;
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "GPL";
