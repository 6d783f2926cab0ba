// SPDX-License-Identifier: Apache-2.0
/*
 * xdpgen: an in-kernel UDP frame generator (this kernel has no pktgen).
 *
 *   xdpgen --dev IFNAME --src IP --dst IP --dst-mac MAC --port N [--sport N]
 *          [--src-mac MAC] [--size BYTES] [--batch N] (--count N | --duration S)
 *          [--obj PATH]
 *   xdpgen --dump-frame ...same addresses...    (prints the template, no root)
 *
 * One template frame (Ethernet + IPv4 + UDP, checksums filled) is handed to
 * bpf_prog_test_run with BPF_F_TEST_XDP_LIVE_FRAMES (Linux >= 5.18): the
 * kernel copies it into page-pool frames, runs xdpgen.bpf.o's program on
 * each, and that program redirects them out of --dev, so real frames leave
 * through the device's ndo_xdp_xmit in batches of --batch, with no skb and
 * no per-frame syscall.  Out of a veth they land in the peer's XDP ring:
 * the peer takes them only while it has NAPI (an XDP program attached, or
 * GRO on).  The veth counts what it took (tx_queue_N_xdp_xmit) and what
 * did not fit its peer's ring (_xdp_xmit_errors); frames refused because
 * the peer has no NAPI appear in neither, hence not_sent below.
 *
 * Prints one JSON object: packets (frames the program redirected), seconds,
 * pps, frame_bytes, batch, xdp_xmit / xdp_xmit_errors (the device's counters
 * over the run, -1 if it has none), not_sent (packets - xdp_xmit) and
 * cpu_seconds (this process: the kernel generates in its syscall).  Exit
 * status 0, or 1 with a message on stderr.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <linux/ethtool.h>
#include <linux/sockios.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef BPF_F_TEST_XDP_LIVE_FRAMES
#define BPF_F_TEST_XDP_LIVE_FRAMES (1U << 1)
#endif

#define MAX_BATCH 256 /* the kernel's TEST_XDP_MAX_BATCH */
#define MAX_PAYLOAD 1472
#define MIN_PAYLOAD 18 /* a 60-byte frame: 64 on the wire with the FCS */
#define FRAME_MAX (sizeof(struct ether_header) + sizeof(struct iphdr) + \
		   sizeof(struct udphdr) + MAX_PAYLOAD)
/* Frames per bpf_prog_test_run call at most (--duration interrupts it sooner). */
#define REPEAT_PER_CALL (1U << 30)

struct options {
	const char *dev;
	const char *obj;
	struct in_addr src, dst;
	uint8_t src_mac[ETH_ALEN], dst_mac[ETH_ALEN];
	int have_src_mac, have_dst_mac;
	uint16_t port, sport;
	size_t size;
	unsigned int batch;
	uint64_t count;
	double duration;
	int dump_frame;
};

struct xmit_counters {
	long long xmit;
	long long errors;
};

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int usage(const char *why)
{
	fprintf(stderr, "xdpgen: %s\n"
		"usage: xdpgen --dev IF --src IP --dst IP --dst-mac MAC --port N [--sport N]\n"
		"              [--src-mac MAC] [--size B] [--batch N] (--count N | --duration S)\n"
		"              [--obj PATH] [--dump-frame]\n", why);
	return -EINVAL;
}

/* A whole-string unsigned number within [min, max]; 0 or -EINVAL. */
static int parse_u64(const char *text, uint64_t min, uint64_t max, uint64_t *out)
{
	char *end;

	errno = 0;
	if (!*text || *text == '-')
		return -EINVAL;
	*out = strtoull(text, &end, 10);
	if (errno || *end || *out < min || *out > max)
		return -EINVAL;
	return 0;
}

static int parse_mac(const char *text, uint8_t *mac)
{
	char tail;

	if (sscanf(text, "%2hhx:%2hhx:%2hhx:%2hhx:%2hhx:%2hhx%c", &mac[0], &mac[1], &mac[2],
		   &mac[3], &mac[4], &mac[5], &tail) != ETH_ALEN)
		return -EINVAL;
	return 0;
}

static int parse_option(int opt, const char *arg, struct options *o)
{
	uint64_t value;
	char *end;

	switch (opt) {
	case 'i':
		if (!*arg || strlen(arg) >= IFNAMSIZ)
			return usage("--dev: not an interface name");
		o->dev = arg;
		return 0;
	case 'S':
		return inet_pton(AF_INET, arg, &o->src) == 1 ? 0 : usage("--src: not an IPv4 address");
	case 'd':
		return inet_pton(AF_INET, arg, &o->dst) == 1 ? 0 : usage("--dst: not an IPv4 address");
	case 'M':
		o->have_dst_mac = !parse_mac(arg, o->dst_mac);
		return o->have_dst_mac ? 0 : usage("--dst-mac: not a MAC address");
	case 'm':
		o->have_src_mac = !parse_mac(arg, o->src_mac);
		return o->have_src_mac ? 0 : usage("--src-mac: not a MAC address");
	case 'p':
		if (parse_u64(arg, 1, 65535, &value))
			return usage("--port: not a port 1-65535");
		o->port = (uint16_t)value;
		return 0;
	case 's':
		if (parse_u64(arg, 1, 65535, &value))
			return usage("--sport: not a port 1-65535");
		o->sport = (uint16_t)value;
		return 0;
	case 'l':
		if (parse_u64(arg, MIN_PAYLOAD, MAX_PAYLOAD, &value))
			return usage("--size: UDP payload must be 18-1472 bytes");
		o->size = value;
		return 0;
	case 'b':
		if (parse_u64(arg, 1, MAX_BATCH, &value))
			return usage("--batch: must be 1-256 frames");
		o->batch = (unsigned int)value;
		return 0;
	case 'c':
		if (parse_u64(arg, 1, UINT64_MAX, &value))
			return usage("--count: not a positive number");
		o->count = value;
		return 0;
	case 't':
		errno = 0;
		o->duration = strtod(arg, &end);
		if (errno || *end || !(o->duration > 0 && o->duration <= 86400))
			return usage("--duration: must be 0-86400 seconds");
		return 0;
	case 'o':
		o->obj = arg;
		return 0;
	case 'D':
		o->dump_frame = 1;
		return 0;
	}
	return usage("unknown option");
}

static int parse_options(int argc, char **argv, struct options *o)
{
	static const struct option longopts[] = {
		{ "dev", required_argument, NULL, 'i' },
		{ "src", required_argument, NULL, 'S' },
		{ "dst", required_argument, NULL, 'd' },
		{ "dst-mac", required_argument, NULL, 'M' },
		{ "src-mac", required_argument, NULL, 'm' },
		{ "port", required_argument, NULL, 'p' },
		{ "sport", required_argument, NULL, 's' },
		{ "size", required_argument, NULL, 'l' },
		{ "batch", required_argument, NULL, 'b' },
		{ "count", required_argument, NULL, 'c' },
		{ "duration", required_argument, NULL, 't' },
		{ "obj", required_argument, NULL, 'o' },
		{ "dump-frame", no_argument, NULL, 'D' },
		{ NULL, 0, NULL, 0 },
	};
	int opt, err;

	o->size = MIN_PAYLOAD;
	o->batch = 64;
	o->sport = 7000;
	opterr = 0;
	while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		err = parse_option(opt, optarg, o);
		if (err)
			return err;
	}
	if (optind != argc)
		return usage("unexpected argument");
	if (!o->src.s_addr || !o->dst.s_addr || !o->port || !o->have_dst_mac)
		return usage("--src, --dst, --dst-mac and --port are required");
	if (o->dump_frame)
		return o->have_src_mac || o->dev ? 0 : usage("--dump-frame needs --src-mac or --dev");
	if (!o->dev)
		return usage("--dev is required");
	if (!o->count == !(o->duration > 0))
		return usage("give exactly one of --count and --duration");
	return 0;
}

static uint32_t sum16(const void *data, size_t len, uint32_t sum)
{
	const uint8_t *byte = data;

	for (; len > 1; len -= 2, byte += 2)
		sum += (uint32_t)byte[0] << 8 | byte[1];
	if (len)
		sum += (uint32_t)byte[0] << 8;
	return sum;
}

static uint16_t fold(uint32_t sum)
{
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return htons((uint16_t)~sum);
}

/* Ethernet + IPv4 + UDP with both checksums and a zero payload; returns its length. */
static size_t build_frame(const struct options *o, uint8_t *frame)
{
	struct ether_header *eth = (struct ether_header *)frame;
	struct iphdr *ip = (struct iphdr *)(eth + 1);
	struct udphdr *udp = (struct udphdr *)(ip + 1);
	uint16_t udp_len = (uint16_t)(sizeof(*udp) + o->size);
	uint32_t pseudo;

	memset(frame, 0, FRAME_MAX);
	memcpy(eth->ether_dhost, o->dst_mac, ETH_ALEN);
	memcpy(eth->ether_shost, o->src_mac, ETH_ALEN);
	eth->ether_type = htons(ETHERTYPE_IP);
	ip->version = 4;
	ip->ihl = 5;
	ip->ttl = 64;
	ip->protocol = IPPROTO_UDP;
	ip->tot_len = htons((uint16_t)(sizeof(*ip) + udp_len));
	ip->saddr = o->src.s_addr;
	ip->daddr = o->dst.s_addr;
	ip->check = fold(sum16(ip, sizeof(*ip), 0));
	udp->source = htons(o->sport);
	udp->dest = htons(o->port);
	udp->len = htons(udp_len);
	pseudo = sum16(&ip->saddr, 8, IPPROTO_UDP + udp_len);
	udp->check = fold(sum16(udp, udp_len, pseudo));
	if (!udp->check)
		udp->check = 0xffff; /* 0 would mean "no checksum" */
	return sizeof(*eth) + sizeof(*ip) + udp_len;
}

static void dump_frame(const uint8_t *frame, size_t len)
{
	size_t i;

	for (i = 0; i < len; i++)
		printf("%02x", frame[i]);
	printf("\n");
}

/* Fills o->src_mac from the device unless --src-mac gave one; returns its ifindex or -errno. */
static int device_ifindex(struct options *o)
{
	struct ifreq ifr = { 0 };
	int fd, err = 0;

	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0)
		return -errno;
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", o->dev);
	if (!o->have_src_mac) {
		if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0) {
			err = -errno;
			goto out;
		}
		memcpy(o->src_mac, ifr.ifr_hwaddr.sa_data, ETH_ALEN);
	}
	if (ioctl(fd, SIOCGIFINDEX, &ifr) < 0) {
		err = -errno;
		goto out;
	}
	err = ifr.ifr_ifindex;
out:
	close(fd);
	return err;
}

static int ethtool(int fd, const char *dev, void *cmd)
{
	struct ifreq ifr = { .ifr_data = cmd };

	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", dev);
	return ioctl(fd, SIOCETHTOOL, &ifr) < 0 ? -errno : 0;
}

static int ends_with(const char *name, const char *suffix)
{
	size_t n = strnlen(name, ETH_GSTRING_LEN), s = strlen(suffix);

	return n >= s && !strncmp(name + n - s, suffix, s);
}

/*
 * The device's XDP transmit counters summed over its queues (a veth's
 * tx_queue_N_xdp_xmit and _xdp_xmit_errors); -1 each where it has none.
 */
static int read_xmit_counters(const char *dev, struct xmit_counters *c)
{
	struct {
		struct ethtool_sset_info hdr;
		uint32_t len;
	} sset = { .hdr = { .cmd = ETHTOOL_GSSET_INFO, .sset_mask = 1ULL << ETH_SS_STATS } };
	struct ethtool_gstrings *names = NULL;
	struct ethtool_stats *stats = NULL;
	uint32_t i, n;
	int fd, err;

	c->xmit = c->errors = -1;
	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0)
		return -errno;
	err = ethtool(fd, dev, &sset);
	n = sset.hdr.sset_mask ? sset.len : 0;
	if (err || !n)
		goto out; /* no statistics: the counters stay unknown */
	names = calloc(1, sizeof(*names) + (size_t)n * ETH_GSTRING_LEN);
	stats = calloc(1, sizeof(*stats) + (size_t)n * sizeof(uint64_t));
	if (!names || !stats) {
		err = -ENOMEM;
		goto out;
	}
	names->cmd = ETHTOOL_GSTRINGS;
	names->string_set = ETH_SS_STATS;
	names->len = n;
	stats->cmd = ETHTOOL_GSTATS;
	stats->n_stats = n;
	err = ethtool(fd, dev, names);
	if (!err)
		err = ethtool(fd, dev, stats);
	if (err)
		goto out;
	for (i = 0; i < n; i++) {
		const char *name = (const char *)names->data + (size_t)i * ETH_GSTRING_LEN;

		if (ends_with(name, "_xdp_xmit"))
			c->xmit = (c->xmit < 0 ? 0 : c->xmit) + (long long)stats->data[i];
		else if (ends_with(name, "_xdp_xmit_errors"))
			c->errors = (c->errors < 0 ? 0 : c->errors) + (long long)stats->data[i];
	}
out:
	free(names);
	free(stats);
	close(fd);
	return err;
}

static long long counter_delta(long long before, long long after)
{
	return before < 0 || after < 0 ? -1 : after - before;
}

static int default_object(char *path, size_t len)
{
	char exe[PATH_MAX];
	ssize_t n;
	char *slash;

	n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n < 0)
		return -errno;
	exe[n] = '\0';
	slash = strrchr(exe, '/');
	if (slash)
		*slash = '\0';
	if ((size_t)snprintf(path, len, "%s/xdpgen.bpf.o", exe) >= len)
		return -ENAMETOOLONG;
	return 0;
}

/* Opens the program's object, points it at ifindex and loads it; -errno on failure. */
static int load_program(const char *path, int ifindex, struct bpf_object **objp)
{
	struct bpf_object *obj;
	struct bpf_map *map, *rodata = NULL;
	uint32_t value = (uint32_t)ifindex;
	size_t size = 0;
	int err;

	obj = bpf_object__open_file(path, NULL);
	if (!obj) {
		err = -errno;
		fprintf(stderr, "xdpgen: cannot open %s: %s\n", path, strerror(-err));
		return err;
	}
	*objp = obj;
	bpf_object__for_each_map(map, obj) {
		if (bpf_map__is_internal(map) && strstr(bpf_map__name(map), ".rodata"))
			rodata = map;
	}
	/* tx_ifindex is the object's only read-only global: .rodata is just it. */
	if (!rodata || !bpf_map__initial_value(rodata, &size) || size != sizeof(value)) {
		fprintf(stderr, "xdpgen: %s has no tx_ifindex\n", path);
		return -ENOENT;
	}
	err = bpf_map__set_initial_value(rodata, &value, sizeof(value));
	if (!err)
		err = bpf_object__load(obj);
	if (err)
		fprintf(stderr, "xdpgen: cannot load %s: %s\n", path, strerror(-err));
	return err;
}

static int read_count(struct bpf_object *obj, uint64_t *total)
{
	struct bpf_map *map = bpf_object__find_map_by_name(obj, "gen_count");
	int cpus = libbpf_num_possible_cpus();
	uint64_t *values;
	uint32_t zero = 0;
	int i, err;

	if (!map || cpus <= 0)
		return -ENOENT;
	values = calloc((size_t)cpus, sizeof(*values));
	if (!values)
		return -ENOMEM;
	err = bpf_map_lookup_elem(bpf_map__fd(map), &zero, values) ? -errno : 0;
	*total = 0;
	for (i = 0; !err && i < cpus; i++)
		*total += values[i];
	free(values);
	return err;
}

static double cpu_seconds(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
	       ru.ru_stime.tv_usec / 1e6;
}

static volatile sig_atomic_t time_is_up;

static void on_alarm(int sig)
{
	(void)sig;
	time_is_up = 1;
}

/* Interrupts the running test run (the kernel checks for signals) after --duration. */
static int arm_timer(double duration)
{
	struct sigaction sa = { .sa_handler = on_alarm }; /* no SA_RESTART: EINTR ends a run */
	struct itimerval timer = { 0 };

	if (sigaction(SIGALRM, &sa, NULL) < 0)
		return -errno;
	timer.it_value.tv_sec = (time_t)duration;
	timer.it_value.tv_usec = (suseconds_t)((duration - (time_t)duration) * 1e6);
	return setitimer(ITIMER_REAL, &timer, NULL) < 0 ? -errno : 0;
}

/*
 * Runs the program on the template until --count frames ran or --duration
 * passed.  Each test run sets up and tears down a page pool, which costs an
 * RCU grace period, so runs are as long as possible: --duration ends one by
 * a signal, and the program's own counter says how many frames it sent.
 */
static int generate(const struct options *o, int prog_fd, const uint8_t *frame, size_t len,
		    double *seconds)
{
	LIBBPF_OPTS(bpf_test_run_opts, run, .data_in = frame, .data_size_in = (uint32_t)len,
		    .flags = BPF_F_TEST_XDP_LIVE_FRAMES, .batch_size = o->batch);
	double start = now();
	uint64_t done = 0, left;
	int err;

	err = o->count ? 0 : arm_timer(o->duration);
	while (!err && !time_is_up && (!o->count || done < o->count)) {
		left = o->count ? o->count - done : REPEAT_PER_CALL;
		run.repeat = left < REPEAT_PER_CALL ? (uint32_t)left : REPEAT_PER_CALL;
		if (!bpf_prog_test_run_opts(prog_fd, &run)) {
			done += run.repeat;
			continue;
		}
		err = -errno;
		if (err == -EINTR && time_is_up)
			err = 0;
		else if (err == -EINVAL && !done)
			fprintf(stderr, "xdpgen: the kernel refused an XDP live-frames test run "
				"(BPF_F_TEST_XDP_LIVE_FRAMES needs Linux >= 5.18)\n");
		else
			fprintf(stderr, "xdpgen: bpf_prog_test_run: %s\n", strerror(-err));
	}
	*seconds = now() - start;
	return err;
}

static void print_totals(const struct options *o, uint64_t packets, double seconds,
			 size_t len, const struct xmit_counters *before,
			 const struct xmit_counters *after, double cpu)
{
	long long xmit = counter_delta(before->xmit, after->xmit);

	printf("{\"packets\": %llu, \"seconds\": %.6f, \"pps\": %.1f, \"frame_bytes\": %zu, "
	       "\"batch\": %u, \"xdp_xmit\": %lld, \"xdp_xmit_errors\": %lld, \"not_sent\": %lld, "
	       "\"cpu_seconds\": %.3f}\n",
	       (unsigned long long)packets, seconds, seconds > 0 ? packets / seconds : 0.0, len,
	       o->batch, xmit, counter_delta(before->errors, after->errors),
	       xmit < 0 ? -1 : (long long)packets - xmit, cpu);
}

/* Loads the program for --dev, generates, prints the totals. */
static int send_frames(const struct options *o, int ifindex, const uint8_t *frame, size_t len)
{
	struct xmit_counters before, after;
	struct bpf_object *obj = NULL;
	char path[PATH_MAX];
	double seconds, cpu;
	uint64_t packets;
	int err;

	err = o->obj ? 0 : default_object(path, sizeof(path));
	if (err) {
		fprintf(stderr, "xdpgen: cannot locate xdpgen.bpf.o: %s\n", strerror(-err));
		goto out;
	}
	err = load_program(o->obj ? o->obj : path, ifindex, &obj);
	if (err)
		goto out;
	read_xmit_counters(o->dev, &before); /* none: the counters stay -1 */
	cpu = cpu_seconds();
	err = generate(o, bpf_program__fd(bpf_object__next_program(obj, NULL)), frame, len,
		       &seconds);
	cpu = cpu_seconds() - cpu;
	if (err)
		goto out;
	read_xmit_counters(o->dev, &after);
	err = read_count(obj, &packets);
	if (err) {
		fprintf(stderr, "xdpgen: cannot read the frame counter: %s\n", strerror(-err));
		goto out;
	}
	print_totals(o, packets, seconds, len, &before, &after, cpu);
out:
	bpf_object__close(obj);
	return err;
}

static int run(struct options *o)
{
	static uint8_t frame[FRAME_MAX];
	int ifindex;
	size_t len;

	if (o->dump_frame && o->have_src_mac) {
		dump_frame(frame, build_frame(o, frame));
		return 0;
	}
	ifindex = device_ifindex(o);
	if (ifindex < 0) {
		fprintf(stderr, "xdpgen: device %s: %s\n", o->dev, strerror(-ifindex));
		return ifindex;
	}
	len = build_frame(o, frame);
	if (o->dump_frame) {
		dump_frame(frame, len);
		return 0;
	}
	return send_frames(o, ifindex, frame, len);
}

int main(int argc, char **argv)
{
	struct options o = { 0 };
	int err;

	err = parse_options(argc, argv, &o);
	if (!err)
		err = run(&o);
	return err ? 1 : 0;
}
