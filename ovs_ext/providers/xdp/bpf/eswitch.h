/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Layout shared by the XDP eSwitch and its userspace (provider.py packs the
 * same bytes; tests/unit/test_xdp_keys.py pins the sizes).
 */
#ifndef FLEXMIG_ESWITCH_H
#define FLEXMIG_ESWITCH_H

#include <linux/types.h>

/* Addresses and ports stay in network byte order, as they are on the wire. */
struct eswitch_flow_key {
	__u32 in_ifindex;
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

/* Per-CPU: out_ifindex is the same on every CPU, the counters are summed. */
struct eswitch_flow_action {
	__u32 out_ifindex;
	__u32 pad;
	__u64 packets;
	__u64 bytes;
};

#define ESWITCH_DEFAULT_CAPACITY 131072
#define ESWITCH_MAX_PORTS 1024

#endif
