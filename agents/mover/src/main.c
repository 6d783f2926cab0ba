// SPDX-License-Identifier: Apache-2.0
/*
 * flexmig-mover: carries a byte stream (a VM's migration stream) between two
 * hosts over libfabric — RMA writes into a ring the receiver registered once,
 * several batches in flight, CRC32C per batch, a credential checked before
 * anything flows.  Same code on RDMA NICs (verbs;ofi_rxm) and TCP (tcp;ofi_rxm).
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "oob.h"
#include "session.h"

#define MAX_BATCH_KIB (64 * 1024)
#define TCP_BATCH_KIB "256"

/* Every tunable once: option, environment variable, default, bounds, help. */
struct tunable {
	const char *opt, *env, *def;
	long min, max;
	const char *help;
};

static const struct tunable tunables[] = {
	{"provider", "FM_MOVER_PROVIDER", "tcp;ofi_rxm", 0, 0,
	 "libfabric provider: verbs;ofi_rxm on RDMA NICs (rdma-core), tcp;ofi_rxm elsewhere"},
	{"batch-kib", "FM_MOVER_BATCH_KIB", "4096", 4, MAX_BATCH_KIB,
	 "batch size in KiB (default 4096: seed 000's 1,024 pages; " TCP_BATCH_KIB " on tcp)"},
	{"depth", "FM_MOVER_DEPTH", "4", 1, FM_MAX_DEPTH - 1,
	 "batches in flight; 1 disables the overlap of filling, transfer and draining"},
	{"slots", "FM_MOVER_SLOTS", "8", 1, FM_MAX_SLOTS, "receiver: slots in its registered ring"},
	{"port", "FM_MOVER_PORT", "7471", 1, 65535, "bootstrap TCP port on the receiver"},
	{"timeout", "FM_MOVER_TIMEOUT", "10", 1, 3600,
	 "seconds allowed for bootstrap, and of peer silence while it owes a completion"},
};

static void usage(FILE *out)
{
	size_t i;

	fprintf(out, "usage: flexmig-mover send|recv [options]\n\n"
		     "  --local ADDR          this host's address to bind (management/fabric)\n"
		     "  --peer ADDR           send: the receiver's address\n"
		     "  --token-file PATH     the migration's credential (or FM_MOVER_TOKEN)\n"
		     "  --input PATH|-        send: read the stream from a file or stdin\n"
		     "  --listen-unix PATH    send: accept the source QEMU's connection here\n"
		     "  --listen-fd FD        send: accept one connection on this inherited listening\n"
		     "                        socket (parallel streams share one socket path)\n"
		     "  --output PATH|-       recv: write the stream to a file or stdout\n"
		     "  --connect-unix PATH   recv: deliver to the destination QEMU's socket\n"
		     "  --stats-file PATH     write the closing statistics (JSON) here\n"
		     "  --ready-file PATH     send: create it once connected to the receiver, before\n"
		     "                        accepting QEMU (the agent starts libvirt after that)\n"
		     "  --inject-corruption N test hook: damage batch N after its CRC\n");
	for (i = 0; i < sizeof(tunables) / sizeof(tunables[0]); i++)
		fprintf(out, "  --%-19s %s [%s, env %s]\n", tunables[i].opt, tunables[i].help,
			tunables[i].def, tunables[i].env);
}

static int tunable_value(const char *name, const char *given, long *out)
{
	size_t i;

	for (i = 0; i < sizeof(tunables) / sizeof(tunables[0]); i++) {
		const struct tunable *t = &tunables[i];
		const char *v = given ? given : getenv(t->env) ? getenv(t->env) : t->def;
		char *end;

		if (strcmp(t->opt, name))
			continue;
		*out = strtol(v, &end, 10);
		if (*end || *out < t->min || *out > t->max) {
			fprintf(stderr, "mover: --%s %s is not in %ld..%ld\n", name, v, t->min,
				t->max);
			return -EINVAL;
		}
		return 0;
	}
	return -EINVAL;
}

static int read_token(const char *path, char *out)
{
	const char *env = getenv("FM_MOVER_TOKEN");
	FILE *f;
	size_t n;

	memset(out, 0, FM_TOKEN_LEN);
	if (!path) {
		if (!env || strlen(env) < 16 || strlen(env) >= FM_TOKEN_LEN)
			return -EINVAL;
		memcpy(out, env, strlen(env));
		return 0;
	}
	f = fopen(path, "r");
	if (!f)
		return -errno;
	n = fread(out, 1, FM_TOKEN_LEN - 1, f);
	fclose(f);
	while (n && (out[n - 1] == '\n' || out[n - 1] == ' '))
		out[--n] = 0;
	return n >= 16 ? 0 : -EINVAL;
}

/*
 * Let libfabric load only the providers asked for ("tcp;ofi_rxm" -> "tcp,ofi_rxm"):
 * probing every installed one (psm's hardware scan sleeps) costs each mover tens
 * of ms before it can take QEMU.  FI_PROVIDER set by the caller wins.
 */
static void load_only(const char *provider)
{
	char list[128];
	char *p;

	snprintf(list, sizeof(list), "%s", provider);
	for (p = list; *p; p++)
		if (*p == ';')
			*p = ',';
	setenv("FI_PROVIDER", list, 0);
}

int fm_parse_args(int argc, char **argv, struct fm_config *c, char *token);
int fm_bootstrap(struct fm_session *s, const char *token);

int main(int argc, char **argv)
{
	static char token[FM_TOKEN_LEN];
	struct fm_config cfg = {0};
	struct fm_session s = {0};
	int ret;

	/* A peer or QEMU closing its socket must be an error we report, not a kill. */
	signal(SIGPIPE, SIG_IGN);
	ret = fm_parse_args(argc, argv, &cfg, token);
	if (ret)
		return ret > 0 ? 0 : 2;
	load_only(cfg.provider);
	s.cfg = &cfg;
	s.oob_fd = s.local_fd = -1;
	ret = fm_bootstrap(&s, token);
	if (!ret)
		ret = strcmp(cfg.role, "send") ? fm_run_receiver(&s) : fm_run_sender(&s);
	if (!ret)
		fm_print_stats(&s);
	else
		fprintf(stderr, "mover: %s failed: %s\n", cfg.role, strerror(-ret));
	if (s.local_fd > 1)
		close(s.local_fd);
	if (s.oob_fd >= 0)
		close(s.oob_fd);
	fm_region_free(&s.data);
	fm_region_free(&s.msgs_tx);
	fm_region_free(&s.msgs_rx);
	fm_fabric_close(&s.fab);
	return ret ? 1 : 0;
}

static const struct option long_opts[] = {
	{"local", 1, 0, 'l'},	     {"peer", 1, 0, 'p'},	 {"token-file", 1, 0, 't'},
	{"input", 1, 0, 'i'},	     {"listen-unix", 1, 0, 'L'}, {"output", 1, 0, 'o'},
	{"connect-unix", 1, 0, 'C'}, {"stats-file", 1, 0, 's'},	 {"inject-corruption", 1, 0, 'X'},
	{"provider", 1, 0, 'P'},     {"batch-kib", 1, 0, 'b'},	 {"depth", 1, 0, 'd'},
	{"slots", 1, 0, 'S'},	     {"port", 1, 0, 'O'},	 {"timeout", 1, 0, 'T'},
	{"listen-fd", 1, 0, 'F'},    {"ready-file", 1, 0, 'R'},	 {"help", 0, 0, 'h'},
	{0, 0, 0, 0},
};

static int finish_config(struct fm_config *c, const char **t, char *token, const char *tok_path)
{
	long v[5];
	const char *names[] = {"batch-kib", "depth", "slots", "port", "timeout"};
	int i;

	c->provider = t[5] ? t[5] : getenv("FM_MOVER_PROVIDER") ? getenv("FM_MOVER_PROVIDER")
								 : "tcp;ofi_rxm";
	/* Where the CPU copies every byte (tcp), a batch that stays in L2 between
	 * the read, the CRC and the send beats seed 000's 4 MiB, which fits a NIC
	 * that DMAs: docs/benchmarks/mover.md. */
	if (!t[0] && !getenv("FM_MOVER_BATCH_KIB") && strstr(c->provider, "tcp"))
		t[0] = TCP_BATCH_KIB;
	for (i = 0; i < 5; i++)
		if (tunable_value(names[i], t[i], &v[i]))
			return -EINVAL;
	c->batch_kib = (uint32_t)v[0];
	c->depth = (uint32_t)v[1];
	c->slots = (uint32_t)v[2];
	c->port = (int)v[3];
	c->timeout_s = (int)v[4];
	if (c->listen_fd != -1 && (c->listen_fd < 0 || fcntl(c->listen_fd, F_GETFD) < 0)) {
		fprintf(stderr, "mover: --listen-fd needs an open descriptor >= 3\n");
		return -EINVAL;
	}
	if (!c->local ||
	    (!strcmp(c->role, "send") &&
	     (!c->peer || !!c->input + !!c->listen_unix + (c->listen_fd >= 0) != 1)) ||
	    (!strcmp(c->role, "recv") && !!c->output == !!c->connect_unix)) {
		fprintf(stderr, "mover: send needs --local, --peer and one of --input/--listen-unix; "
				"recv needs --local and one of --output/--connect-unix\n");
		return -EINVAL;
	}
	if (read_token(tok_path, token)) {
		fprintf(stderr, "mover: no credential: --token-file or FM_MOVER_TOKEN "
				"(16..63 characters) is required\n");
		return -EINVAL;
	}
	c->token = token;
	return 0;
}

static int parse_fd(const char *v)
{
	char *end;
	long fd = strtol(v, &end, 10);

	return *end || fd < 3 || fd > 65535 ? -2 : (int)fd;
}

int fm_parse_args(int argc, char **argv, struct fm_config *c, char *token)
{
	const char *tun[6] = {0}, *tok_path = NULL;
	int opt;

	c->inject_corruption = -1;
	c->listen_fd = -1;
	if (argc < 2 || (strcmp(argv[1], "send") && strcmp(argv[1], "recv"))) {
		usage(argc > 1 && !strcmp(argv[1], "--help") ? stdout : stderr);
		return argc > 1 && !strcmp(argv[1], "--help") ? 1 : -EINVAL;
	}
	c->role = argv[1];
	optind = 2;
	while ((opt = getopt_long(argc, argv, "", long_opts, NULL)) != -1) {
		switch (opt) {
		case 'l': c->local = optarg; break;
		case 'p': c->peer = optarg; break;
		case 't': tok_path = optarg; break;
		case 'i': c->input = optarg; break;
		case 'L': c->listen_unix = optarg; break;
		case 'F': c->listen_fd = parse_fd(optarg); break;
		case 'o': c->output = optarg; break;
		case 'C': c->connect_unix = optarg; break;
		case 's': c->stats_file = optarg; break;
		case 'R': c->ready_file = optarg; break;
		case 'X': c->inject_corruption = atoll(optarg); break;
		case 'b': tun[0] = optarg; break;
		case 'd': tun[1] = optarg; break;
		case 'S': tun[2] = optarg; break;
		case 'O': tun[3] = optarg; break;
		case 'T': tun[4] = optarg; break;
		case 'P': tun[5] = optarg; break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return -EINVAL;
		}
	}
	return finish_config(c, tun, token, tok_path);
}
