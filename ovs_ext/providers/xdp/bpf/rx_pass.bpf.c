// SPDX-License-Identifier: GPL-2.0
/*
 * XDP_PASS on the receiving end of a veth that the eSwitch redirects into.
 *
 * A frame redirected into a veth (ndo_xdp_xmit) lands in the peer's NAPI
 * ring, which exists only while the peer has an XDP program (or GRO, which
 * would also aggregate TCP and hand OVS's AF_PACKET oversized frames).  This
 * program gives the peer that ring and changes nothing else.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int rx_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "GPL";
