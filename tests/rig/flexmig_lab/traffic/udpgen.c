// SPDX-License-Identifier: Apache-2.0
/*
 * udpgen: a UDP packet generator and sink fast enough for packet-rate
 * comparisons (iperf3's single sender thread caps at ~250k pps here).
 *
 *   udpgen send --dst IP --port N [--sport N] [--size BYTES] [--batch N]
 *               (--count N | --duration SEC) [--rate PPS]
 *               [--raw IFNAME --src IP --dst-mac MAC]
 *   udpgen recv --port N [--count N] [--duration SEC] [--idle-ms MS]
 *
 * Batches of datagrams go through one sendmmsg/recvmmsg syscall each.  Both
 * print one JSON object on stdout at the end; exit status 0 or 1 on error.
 *
 * Sequence numbers: the socket sender starts every datagram of 12 bytes or
 * more with a magic and its 64-bit sequence number (0, 1, ...).  The sink
 * reports, of the datagrams that carry one, how many distinct numbers came,
 * duplicates, late arrivals, and the missing numbers below the highest seen
 * (count, ranges, longest range): loss and duplication per packet, e.g.
 * across a live migration, not only a difference of two totals.
 * Datagrams of 20 bytes or more also carry the moment they were sent
 * (CLOCK_REALTIME, ns): all lab hosts and namespaces share the host's clock, so
 * a sink inside a guest, whose own clock is not the host's, still tells when
 * the packets around a gap were sent.  Each forward jump of the numbers (a gap
 * as it was seen, before any late arrival fills it) is reported with the send
 * times of the datagrams on both sides: e.g. when the first packet reached a
 * VM at its new host after a live migration.
 * The sender retries a batch the kernel could not take (ENOBUFS/EAGAIN) so
 * "--count N" means exactly N datagrams left the socket.
 *
 * --raw sends the same datagrams as prebuilt Ethernet frames on an AF_PACKET
 * socket with PACKET_QDISC_BYPASS: no UDP/IP output path, no qdisc, about
 * twice the packet rate of the UDP socket, so a switch can be pushed past
 * what an ordinary sender reaches on a shared 2-core machine.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <sys/ioctl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_BATCH 256
#define MAX_PAYLOAD 65507
#define SEQ_MAGIC 0x464d5351u /* "FMSQ" */
#define SEQ_HEADER 12 /* magic (4) + sequence number (8), network order */
#define SEQ_MAX (1u << 24) /* numbers the sink tracks: a 2 MiB bitmap */
#define SEQ_TIMED 20 /* + send time (8), CLOCK_REALTIME ns, network order */
#define MAX_JUMPS 32 /* gaps reported with their send times; the rest counted */

struct options {
	const char *mode;
	struct in_addr dst;
	int have_dst;
	uint16_t port;
	uint16_t sport;
	size_t size;
	unsigned int batch;
	uint64_t count;
	double duration;
	uint64_t rate;
	int idle_ms;
	const char *raw_if;
	struct in_addr src;
	uint8_t dst_mac[ETH_ALEN];
	int have_dst_mac;
};

struct totals {
	uint64_t packets;
	uint64_t bytes;
	double first;
	double last;
};

/* A forward jump of the sequence numbers, as it arrived. */
struct jump {
	uint64_t seq; /* the first number after the gap */
	uint64_t gap; /* numbers skipped */
	uint64_t before_ns; /* send time of the highest number before it (0: untimed) */
	uint64_t after_ns; /* send time of seq (0: untimed) */
};

/* What the sink saw of the sender's sequence numbers. */
struct seqs {
	uint8_t *seen; /* bitmap of SEQ_MAX numbers, allocated at the first one */
	uint64_t sequenced;
	uint64_t unique;
	uint64_t duplicates;
	uint64_t late; /* below the highest number seen before it */
	uint64_t beyond; /* numbers >= SEQ_MAX: counted, not tracked */
	int64_t highest;
	uint64_t highest_ns; /* send time of the highest number */
	uint64_t first_ns; /* send time of the first timed datagram */
	uint64_t njumps;
	struct jump jumps[MAX_JUMPS];
};

static void put_u64(uint8_t *at, uint64_t v)
{
	uint32_t hi = htonl((uint32_t)(v >> 32)), lo = htonl((uint32_t)v);

	memcpy(at, &hi, 4);
	memcpy(at + 4, &lo, 4);
}

static uint64_t get_u64(const uint8_t *at)
{
	uint32_t hi, lo;

	memcpy(&hi, at, 4);
	memcpy(&lo, at + 4, 4);
	return (uint64_t)ntohl(hi) << 32 | ntohl(lo);
}

static uint64_t wall_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void seq_stamp(uint8_t *hdr, uint64_t seq, int timed)
{
	uint32_t magic = htonl(SEQ_MAGIC);

	memcpy(hdr, &magic, 4);
	put_u64(hdr + 4, seq);
	if (timed)
		put_u64(hdr + SEQ_HEADER, wall_ns());
}

static void seq_jump(struct seqs *q, uint64_t seq, uint64_t sent_ns)
{
	if (q->highest >= 0 && seq > (uint64_t)q->highest + 1) {
		if (q->njumps < MAX_JUMPS)
			q->jumps[q->njumps] = (struct jump){ seq, seq - (uint64_t)q->highest - 1,
							     q->highest_ns, sent_ns };
		q->njumps++;
	}
	q->highest = (int64_t)seq;
	q->highest_ns = sent_ns;
}

static int seq_note(struct seqs *q, const uint8_t *buf, size_t len)
{
	uint64_t seq, sent_ns;
	uint32_t magic;

	if (len < SEQ_HEADER)
		return 0;
	memcpy(&magic, buf, 4);
	if (ntohl(magic) != SEQ_MAGIC)
		return 0;
	seq = get_u64(buf + 4);
	sent_ns = len >= SEQ_TIMED ? get_u64(buf + SEQ_HEADER) : 0;
	if (sent_ns && !q->first_ns)
		q->first_ns = sent_ns;
	q->sequenced++;
	if (seq >= SEQ_MAX) {
		q->beyond++;
		return 0;
	}
	if (!q->seen) {
		q->seen = calloc(SEQ_MAX / 8, 1);
		if (!q->seen)
			return -ENOMEM;
		q->highest = -1;
	}
	if (q->seen[seq / 8] & (1u << (seq % 8))) {
		q->duplicates++;
		return 0;
	}
	q->seen[seq / 8] |= (uint8_t)(1u << (seq % 8));
	q->unique++;
	if ((int64_t)seq < q->highest)
		q->late++;
	else
		seq_jump(q, seq, sent_ns);
	return 0;
}

/* Missing numbers below the highest seen: how many, in how many runs, the longest. */
static void seq_report(const struct seqs *q)
{
	uint64_t missing = 0, runs = 0, longest = 0, run = 0;
	int64_t i;

	for (i = 0; q->seen && i <= q->highest; i++) {
		if (q->seen[i / 8] & (1u << (i % 8))) {
			run = 0;
			continue;
		}
		missing++;
		if (!run++)
			runs++;
		if (run > longest)
			longest = run;
	}
	printf(", \"sequenced_packets\": %llu, \"unique_packets\": %llu, \"duplicates\": %llu, "
	       "\"late\": %llu, \"highest_seq\": %lld, \"missing\": %llu, \"missing_runs\": %llu, "
	       "\"longest_missing_run\": %llu, \"untracked\": %llu",
	       (unsigned long long)q->sequenced, (unsigned long long)q->unique,
	       (unsigned long long)q->duplicates, (unsigned long long)q->late,
	       (long long)(q->seen ? q->highest : -1), (unsigned long long)missing,
	       (unsigned long long)runs, (unsigned long long)longest, (unsigned long long)q->beyond);
	printf(", \"first_sent_ns\": %llu, \"last_sent_ns\": %llu, \"jumps_seen\": %llu, \"jumps\": [",
	       (unsigned long long)q->first_ns, (unsigned long long)q->highest_ns,
	       (unsigned long long)q->njumps);
	for (i = 0; i < (int64_t)q->njumps && i < MAX_JUMPS; i++)
		printf("%s{\"seq\": %llu, \"gap\": %llu, \"before_ns\": %llu, \"after_ns\": %llu}",
		       i ? ", " : "", (unsigned long long)q->jumps[i].seq,
		       (unsigned long long)q->jumps[i].gap, (unsigned long long)q->jumps[i].before_ns,
		       (unsigned long long)q->jumps[i].after_ns);
	printf("]");
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_until(double when)
{
	double left = when - now();
	struct timespec ts;

	if (left <= 0)
		return;
	ts.tv_sec = (time_t)left;
	ts.tv_nsec = (long)((left - ts.tv_sec) * 1e9);
	nanosleep(&ts, NULL);
}

static int usage(void)
{
	fprintf(stderr,
		"usage: udpgen send --dst IP --port N [--sport N] [--size B] [--batch N]\n"
		"                   (--count N | --duration S) [--rate PPS]\n"
		"                   [--raw IFNAME --src IP --dst-mac MAC]\n"
		"       udpgen recv --port N [--count N] [--duration S] [--idle-ms MS]\n");
	return -EINVAL;
}

static int parse_options(int argc, char **argv, struct options *o)
{
	static const struct option longopts[] = {
		{ "dst", required_argument, NULL, 'd' },
		{ "port", required_argument, NULL, 'p' },
		{ "sport", required_argument, NULL, 's' },
		{ "size", required_argument, NULL, 'l' },
		{ "batch", required_argument, NULL, 'b' },
		{ "count", required_argument, NULL, 'c' },
		{ "duration", required_argument, NULL, 't' },
		{ "rate", required_argument, NULL, 'r' },
		{ "idle-ms", required_argument, NULL, 'i' },
		{ "raw", required_argument, NULL, 'R' },
		{ "src", required_argument, NULL, 'S' },
		{ "dst-mac", required_argument, NULL, 'M' },
		{ NULL, 0, NULL, 0 },
	};
	int opt;

	if (argc < 2)
		return usage();
	o->mode = argv[1];
	o->size = 18; /* 64-byte Ethernet frames */
	o->batch = 64;
	o->idle_ms = 1000;
	optind = 2;
	while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (opt) {
		case 'd':
			if (inet_pton(AF_INET, optarg, &o->dst) != 1)
				return usage();
			o->have_dst = 1;
			break;
		case 'p':
			o->port = (uint16_t)atoi(optarg);
			break;
		case 's':
			o->sport = (uint16_t)atoi(optarg);
			break;
		case 'l':
			o->size = strtoul(optarg, NULL, 10);
			break;
		case 'b':
			o->batch = (unsigned int)atoi(optarg);
			break;
		case 'c':
			o->count = strtoull(optarg, NULL, 10);
			break;
		case 't':
			o->duration = atof(optarg);
			break;
		case 'r':
			o->rate = strtoull(optarg, NULL, 10);
			break;
		case 'i':
			o->idle_ms = atoi(optarg);
			break;
		case 'R':
			o->raw_if = optarg;
			break;
		case 'S':
			if (inet_pton(AF_INET, optarg, &o->src) != 1)
				return usage();
			break;
		case 'M':
			if (sscanf(optarg, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &o->dst_mac[0],
				   &o->dst_mac[1], &o->dst_mac[2], &o->dst_mac[3], &o->dst_mac[4],
				   &o->dst_mac[5]) != ETH_ALEN)
				return usage();
			o->have_dst_mac = 1;
			break;
		default:
			return usage();
		}
	}
	if (!o->port || !o->batch || o->batch > MAX_BATCH || !o->size || o->size > MAX_PAYLOAD)
		return usage();
	if (!strcmp(o->mode, "send") && (!o->have_dst || (!o->count && o->duration <= 0)))
		return usage();
	if (strcmp(o->mode, "send") && strcmp(o->mode, "recv"))
		return usage();
	if (o->raw_if && (!o->have_dst_mac || !o->src.s_addr || o->size > 1472))
		return usage();
	return 0;
}

static int open_socket(const struct options *o, uint16_t bind_port)
{
	struct sockaddr_in addr = { .sin_family = AF_INET, .sin_port = htons(bind_port) };
	int buf = 8 << 20;
	int fd;

	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0)
		return -errno;
	setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof(buf));
	setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof(buf));
	if (bind_port && bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0)
		goto fail;
	if (o->have_dst && !strcmp(o->mode, "send")) {
		addr.sin_addr = o->dst;
		addr.sin_port = htons(o->port);
		if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0)
			goto fail;
	}
	return fd;
fail:
	buf = -errno;
	close(fd);
	return buf;
}

static uint16_t ip_checksum(const void *hdr, size_t len)
{
	const uint16_t *word = hdr;
	uint32_t sum = 0;

	for (; len > 1; len -= 2)
		sum += *word++;
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/* Ethernet + IPv4 + UDP (checksum 0: optional in IPv4) + zero payload. */
static size_t build_frame(const struct options *o, const uint8_t *src_mac, uint8_t *frame)
{
	struct ether_header *eth = (struct ether_header *)frame;
	struct iphdr *ip = (struct iphdr *)(eth + 1);
	struct udphdr *udp = (struct udphdr *)(ip + 1);

	memcpy(eth->ether_dhost, o->dst_mac, ETH_ALEN);
	memcpy(eth->ether_shost, src_mac, ETH_ALEN);
	eth->ether_type = htons(ETHERTYPE_IP);
	ip->version = 4;
	ip->ihl = 5;
	ip->ttl = 64;
	ip->protocol = IPPROTO_UDP;
	ip->tot_len = htons((uint16_t)(sizeof(*ip) + sizeof(*udp) + o->size));
	ip->saddr = o->src.s_addr;
	ip->daddr = o->dst.s_addr;
	ip->check = ip_checksum(ip, sizeof(*ip));
	udp->source = htons(o->sport);
	udp->dest = htons(o->port);
	udp->len = htons((uint16_t)(sizeof(*udp) + o->size));
	return sizeof(*eth) + sizeof(*ip) + sizeof(*udp) + o->size;
}

static int open_raw(const struct options *o, uint8_t *frame, size_t *frame_len)
{
	struct sockaddr_ll ll = { .sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_IP) };
	struct ifreq ifr = { 0 };
	int one = 1;
	int fd, err;

	fd = socket(AF_PACKET, SOCK_RAW, 0);
	if (fd < 0)
		return -errno;
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", o->raw_if);
	if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0 || ioctl(fd, SIOCGIFINDEX, &ifr) < 0)
		goto fail;
	ll.sll_ifindex = ifr.ifr_ifindex;
	if (bind(fd, (struct sockaddr *)&ll, sizeof(ll)) < 0)
		goto fail;
	setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof(one));
	/* SIOCGIFINDEX overwrote the union: fetch the address again. */
	if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0)
		goto fail;
	*frame_len = build_frame(o, (uint8_t *)ifr.ifr_hwaddr.sa_data, frame);
	return fd;
fail:
	err = -errno;
	close(fd);
	return err;
}

/* Send one batch completely; returns 0 or -errno. */
static int send_batch(int fd, struct mmsghdr *msgs, unsigned int n)
{
	unsigned int done = 0;
	int rc;

	while (done < n) {
		rc = sendmmsg(fd, msgs + done, n - done, 0);
		if (rc < 0) {
			if (errno == ENOBUFS || errno == EAGAIN || errno == EINTR ||
			    errno == ECONNREFUSED)
				continue;
			return -errno;
		}
		done += rc;
	}
	return 0;
}

static int run_send(const struct options *o, struct totals *t)
{
	static char payload[MAX_PAYLOAD];
	static uint8_t hdrs[MAX_BATCH][SEQ_TIMED];
	struct mmsghdr msgs[MAX_BATCH];
	struct iovec iov = { .iov_base = payload, .iov_len = o->size };
	struct iovec seq_iovs[MAX_BATCH][2];
	double end, next;
	unsigned int i, n;
	int fd, err = 0, stamped, timed;
	size_t hdr_len;

	fd = o->raw_if ? open_raw(o, (uint8_t *)payload, &iov.iov_len) : open_socket(o, o->sport);
	if (fd < 0)
		return fd;
	/* Raw frames are prebuilt whole, one for all: only the socket path numbers them. */
	stamped = !o->raw_if && o->size >= SEQ_HEADER;
	timed = stamped && o->size >= SEQ_TIMED;
	hdr_len = timed ? SEQ_TIMED : SEQ_HEADER;
	memset(msgs, 0, sizeof(msgs));
	for (i = 0; i < o->batch; i++) {
		seq_iovs[i][0] = (struct iovec){ .iov_base = hdrs[i], .iov_len = hdr_len };
		seq_iovs[i][1] = (struct iovec){ .iov_base = payload, .iov_len = stamped ? o->size - hdr_len : 0 };
		msgs[i].msg_hdr.msg_iov = stamped ? seq_iovs[i] : &iov;
		msgs[i].msg_hdr.msg_iovlen = stamped ? 2 : 1;
	}
	t->first = now();
	end = o->duration > 0 ? t->first + o->duration : 0;
	next = t->first;
	while (!o->count || t->packets < o->count) {
		if (end && now() >= end)
			break;
		n = o->batch;
		if (o->count && o->count - t->packets < n)
			n = (unsigned int)(o->count - t->packets);
		if (o->rate) {
			sleep_until(next);
			next += (double)n / o->rate;
		}
		for (i = 0; stamped && i < n; i++)
			seq_stamp(hdrs[i], t->packets + i, timed);
		err = send_batch(fd, msgs, n);
		if (err)
			goto out;
		t->packets += n;
		t->bytes += (uint64_t)n * o->size; /* UDP payload, as the receiver counts */
	}
out:
	t->last = now();
	close(fd);
	return err;
}

static int run_recv(const struct options *o, struct totals *t, struct seqs *q)
{
	static char bufs[MAX_BATCH][2048];
	struct mmsghdr msgs[MAX_BATCH];
	struct iovec iovs[MAX_BATCH];
	struct pollfd pfd;
	double start, end;
	int fd, rc, i, err = 0;

	fd = open_socket(o, o->port);
	if (fd < 0)
		return fd;
	for (i = 0; i < MAX_BATCH; i++) {
		iovs[i].iov_base = bufs[i];
		iovs[i].iov_len = sizeof(bufs[i]);
		memset(&msgs[i], 0, sizeof(msgs[i]));
		msgs[i].msg_hdr.msg_iov = &iovs[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
	}
	/* Ready: a caller may wait for this line before starting the sender. */
	fprintf(stderr, "listening\n");
	start = now();
	end = o->duration > 0 ? start + o->duration : 0;
	pfd.fd = fd;
	pfd.events = POLLIN;
	while (!o->count || t->packets < o->count) {
		int wait_ms = t->packets ? o->idle_ms : 100;

		if (end && now() >= end)
			break;
		rc = poll(&pfd, 1, wait_ms);
		if (rc < 0 && errno != EINTR) {
			err = -errno;
			goto out;
		}
		if (rc == 0) {
			if (t->packets)
				break; /* the stream went idle: it is over */
			continue;
		}
		rc = recvmmsg(fd, msgs, MAX_BATCH, MSG_DONTWAIT, NULL);
		if (rc < 0) {
			if (errno == EAGAIN || errno == EINTR)
				continue;
			err = -errno;
			goto out;
		}
		if (!t->packets)
			t->first = now();
		for (i = 0; i < rc; i++) {
			t->bytes += msgs[i].msg_len;
			err = seq_note(q, (const uint8_t *)bufs[i], msgs[i].msg_len);
			if (err)
				goto out;
		}
		t->packets += rc;
		t->last = now();
	}
out:
	close(fd);
	return err;
}

int main(int argc, char **argv)
{
	struct options o = { 0 };
	struct totals t = { 0 };
	struct seqs q = { 0 };
	const char *prefix;
	double seconds;
	int err;

	err = parse_options(argc, argv, &o);
	if (err)
		return 1;
	if (!strcmp(o.mode, "send")) {
		err = run_send(&o, &t);
		prefix = "sent";
	} else {
		err = run_recv(&o, &t, &q);
		prefix = "received";
	}
	if (err) {
		fprintf(stderr, "udpgen %s: %s\n", o.mode, strerror(-err));
		return 1;
	}
	seconds = t.last > t.first ? t.last - t.first : 0;
	printf("{\"%s_packets\": %llu, \"%s_bytes\": %llu, \"seconds\": %.6f, \"pps\": %.0f",
	       prefix, (unsigned long long)t.packets, prefix, (unsigned long long)t.bytes, seconds,
	       seconds > 0 ? t.packets / seconds : 0.0);
	if (strcmp(o.mode, "send"))
		seq_report(&q);
	printf("}\n");
	free(q.seen);
	return 0;
}
