// SPDX-License-Identifier: GPL-2.0
/*
 * softirq_time: nanoseconds each CPU spends in the network softirqs
 * (NET_TX, NET_RX), measured at the handlers' entry and exit.
 *
 * Why: /proc/stat's softirq column is sampled by the scheduler tick (this
 * kernel has no IRQ time accounting), so short bursts between ticks can be
 * missed or over-counted; the benchmark compares a path whose work runs in
 * softirq with one whose work runs in NAPI threads (exact runtime), and both
 * need the same precision.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define NET_TX_SOFTIRQ 2
#define NET_RX_SOFTIRQ 3

enum slot { SLOT_ENTERED, SLOT_NET_NS, SLOT_OTHER_NS, SLOT_MAX };

/* The tracepoint's record: the common header, then the vector number. */
struct softirq_args {
	__u64 common;
	__u32 vec;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SLOT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} softirq_ns SEC(".maps");

static __always_inline __u64 *slot(__u32 key)
{
	return bpf_map_lookup_elem(&softirq_ns, &key);
}

SEC("tracepoint/irq/softirq_entry")
int softirq_entry(struct softirq_args *args)
{
	__u64 *entered = slot(SLOT_ENTERED);

	if (entered)
		*entered = bpf_ktime_get_ns();
	return 0;
}

SEC("tracepoint/irq/softirq_exit")
int softirq_exit(struct softirq_args *args)
{
	__u64 *entered = slot(SLOT_ENTERED);
	__u32 vec = args->vec;
	__u64 *total;

	if (!entered || !*entered)
		return 0; /* the handler started before we attached */
	total = slot(vec == NET_TX_SOFTIRQ || vec == NET_RX_SOFTIRQ ? SLOT_NET_NS : SLOT_OTHER_NS);
	if (total)
		*total += bpf_ktime_get_ns() - *entered;
	*entered = 0;
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
