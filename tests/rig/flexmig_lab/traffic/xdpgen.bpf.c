// SPDX-License-Identifier: GPL-2.0
/*
 * xdpgen's XDP program: the kernel runs it on every copy of the template
 * frame that bpf_prog_test_run (BPF_F_TEST_XDP_LIVE_FRAMES) makes; it counts
 * the frame and redirects it out of the generator's device, so real frames
 * leave through that device's ndo_xdp_xmit (a veth puts them into its peer's
 * ring, as a NIC queue would hand them to the host).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* Set by xdpgen before the object is loaded. */
const volatile __u32 tx_ifindex;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} gen_count SEC(".maps");

SEC("xdp")
int xdpgen_tx(struct xdp_md *ctx)
{
	__u32 zero = 0;
	__u64 *count;

	count = bpf_map_lookup_elem(&gen_count, &zero);
	if (count)
		(*count)++;
	return bpf_redirect(tx_ifindex, 0);
}

char LICENSE[] SEC("license") = "GPL";
