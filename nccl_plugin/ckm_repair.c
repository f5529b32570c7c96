/* See ckm_repair.h. The store is a list of pieces guarded by one mutex (the proxy thread and
 * the progress thread both send); the service thread polls its socket every 100 ms so the
 * library's destructor can stop it. */
#define _GNU_SOURCE
#include "ckm_repair.h"

#include <arpa/inet.h>
#include <endian.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ckm_config.h"
#include "ckm_crypto.h"
#include "ckm_wire.h"

#define MAX_RANGES 256 /* checkmate/protocol/repair.py */
#define RATE (64.0 * (1 << 20)) /* bytes per second, as REPAIR_RATE (checkmate/train/repair.py) */
#define BURST (1.0 * (1 << 20))
#define TOS 0x60

struct piece {
	uint64_t iteration, offset;
	uint32_t count;
	uint16_t partition, bucket;
	float *data;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct piece *g_p;
static size_t g_n, g_cap, g_bytes;
static uint64_t g_newest, g_gone_below; /* iterations below g_gone_below are no longer held */
static int g_started, g_fd = -1, g_stop;
static pthread_t g_thread;
static uint64_t g_requests, g_answered, g_gone, g_dropped;

static void drop_oldest_iteration(void)
{
	uint64_t old = UINT64_MAX;
	for (size_t i = 0; i < g_n; i++)
		if (g_p[i].iteration < old)
			old = g_p[i].iteration;
	size_t k = 0;
	for (size_t i = 0; i < g_n; i++) {
		if (g_p[i].iteration == old) {
			g_bytes -= (size_t)g_p[i].count * 4;
			free(g_p[i].data);
		} else {
			g_p[k++] = g_p[i];
		}
	}
	g_n = k;
	if (old != UINT64_MAX && old + 1 > g_gone_below)
		g_gone_below = old + 1;
}

void ckm_repair_retain(uint64_t iteration, uint64_t offset, uint32_t count, uint16_t partition,
		       uint16_t bucket, const void *data)
{
	if (!g_cfg.repair_keep || !count)
		return;
	float *copy = malloc((size_t)count * 4);
	if (!copy)
		return; /* the shadow re-seeds if this piece is lost */
	memcpy(copy, data, (size_t)count * 4);
	pthread_mutex_lock(&g_mu);
	if (iteration > g_newest)
		g_newest = iteration;
	while (g_n && g_newest >= g_gone_below + g_cfg.repair_keep)
		drop_oldest_iteration(); /* keep the last repair_keep iterations */
	while (g_n && g_bytes + (size_t)count * 4 > g_cfg.repair_bytes)
		drop_oldest_iteration(); /* and at most repair_bytes */
	if (g_n == g_cap) {
		size_t cap = g_cap ? 2 * g_cap : 1024;
		struct piece *p = realloc(g_p, cap * sizeof *p);
		if (!p) {
			pthread_mutex_unlock(&g_mu);
			free(copy);
			return;
		}
		g_p = p;
		g_cap = cap;
	}
	g_p[g_n++] = (struct piece){iteration, offset, count, partition, bucket, copy};
	g_bytes += (size_t)count * 4;
	pthread_mutex_unlock(&g_mu);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double g_tokens = BURST, g_at;

static void pace(size_t n)
{
	double t = now_s();
	g_tokens += (t - g_at) * RATE;
	if (g_tokens > BURST)
		g_tokens = BURST;
	g_at = t;
	g_tokens -= (double)n;
	if (g_tokens < 0)
		usleep((useconds_t)(-g_tokens / RATE * 1e6));
}

static void tag(struct ckm_hdr *h, uint8_t flags, uint16_t part, uint8_t dt, uint64_t it,
		uint64_t off, uint32_t count, uint32_t crc)
{
	uint64_t t = ckm_data_tag(g_cfg.k0, g_cfg.k1, g_cfg.job, flags, part, dt, it, off, count,
				  crc);
	h->fec_index = (uint8_t)(t >> 48);
	h->fec_k = (uint8_t)(t >> 40);
	h->fec_m = (uint8_t)(t >> 32);
	h->fec_group = htonl((uint32_t)t);
}

static void answer(const struct ckm_hdr *rq, uint8_t flags, uint64_t off, uint32_t count,
		   uint16_t bucket, uint8_t dt, const void *data, const struct sockaddr_in *to)
{
	struct ckm_hdr h;
	memset(&h, 0, sizeof h);
	size_t len = dt == CKM_DT_FLOAT32 ? (size_t)count * 4 : 0;
	uint32_t crc = ckm_crc32c(data, len);
	h.magic = htons(CKM_MAGIC);
	h.version = CKM_VERSION;
	h.flags = flags;
	h.job_id = htonl(g_cfg.job);
	h.epoch = rq->epoch; /* the shadow's current session, as the request carried it */
	h.token = rq->token;
	h.iteration = rq->iteration;
	h.offset = htobe64(off);
	h.count = htonl(count);
	h.bucket = htons(bucket);
	h.partition = rq->partition;
	h.dtype = dt;
	h.crc32c = htonl(crc);
	tag(&h, flags, ntohs(rq->partition), dt, be64toh(rq->iteration), off, count, crc);
	struct iovec iov[2] = {{&h, sizeof h}, {(void *)data, len}};
	struct msghdr m = {.msg_name = (void *)to, .msg_namelen = sizeof *to, .msg_iov = iov,
			   .msg_iovlen = len ? 2 : 1};
	pace(sizeof h + len);
	if (sendmsg(g_fd, &m, 0) >= 0)
		g_answered++;
}

/* One request: validated as checkmate/train/repair.py validates it, answered from the store. */
static void handle(const uint8_t *buf, ssize_t n, const struct sockaddr_in *from)
{
	struct ckm_hdr h;
	if (n < CKM_HEADER_LEN) {
		g_dropped++;
		return;
	}
	memcpy(&h, buf, sizeof h);
	uint32_t count = ntohl(h.count), crc = ntohl(h.crc32c);
	const uint8_t *pay = buf + CKM_HEADER_LEN;
	if (ntohs(h.magic) != CKM_MAGIC || h.version != CKM_VERSION || h.dtype != CKM_DT_BYTES ||
	    (uint64_t)count != (uint64_t)(n - CKM_HEADER_LEN) || ntohl(h.job_id) != g_cfg.job ||
	    h.flags != CKM_F_NACK || ckm_crc32c(pay, count) != crc ||
	    count % 16 || count > 16 * MAX_RANGES || ntohs(h.partition) >= g_cfg.partitions) {
		g_dropped++; /* malformed, another job's, or a control request (rank 0's Python) */
		return;
	}
	uint64_t it = be64toh(h.iteration), t = ckm_data_tag(g_cfg.k0, g_cfg.k1, g_cfg.job,
		h.flags, ntohs(h.partition), h.dtype, it, be64toh(h.offset), count, crc);
	if (h.fec_index != (uint8_t)(t >> 48) || h.fec_k != (uint8_t)(t >> 40) ||
	    h.fec_m != (uint8_t)(t >> 32) || ntohl(h.fec_group) != (uint32_t)t) {
		g_dropped++; /* not from a shadow of this job */
		return;
	}
	g_requests++;
	uint16_t part = ntohs(h.partition);
	pthread_mutex_lock(&g_mu);
	if (it > g_newest) {
		pthread_mutex_unlock(&g_mu); /* not sent yet: the shadow asked early */
		return;
	}
	if (it < g_gone_below) {
		pthread_mutex_unlock(&g_mu);
		g_gone++;
		answer(&h, CKM_F_ACK | CKM_F_NACK, 0, 0, 0, CKM_DT_BYTES, NULL, from);
		return;
	}
	for (uint32_t r = 0; r < count; r += 16) {
		uint64_t a, b;
		memcpy(&a, pay + r, 8);
		memcpy(&b, pay + r + 8, 8);
		a = be64toh(a);
		b = be64toh(b);
		for (size_t i = 0; i < g_n && a < b; i++) {
			const struct piece *p = &g_p[i];
			uint64_t lo = p->offset > a ? p->offset : a;
			uint64_t hi = p->offset + p->count < b ? p->offset + p->count : b;
			if (p->iteration != it || p->partition != part || lo >= hi)
				continue;
			answer(&h, CKM_F_ACK, lo, (uint32_t)(hi - lo), p->bucket, CKM_DT_FLOAT32,
			       p->data + (lo - p->offset), from);
		}
	}
	pthread_mutex_unlock(&g_mu);
}

static void *serve(void *arg)
{
	(void)arg;
	uint8_t buf[CKM_HEADER_LEN + 16 * MAX_RANGES + 64];
	while (!__atomic_load_n(&g_stop, __ATOMIC_RELAXED)) {
		struct pollfd p = {g_fd, POLLIN, 0};
		if (poll(&p, 1, 100) <= 0)
			continue;
		struct sockaddr_in from;
		socklen_t fl = sizeof from;
		ssize_t n = recvfrom(g_fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&from,
				     &fl);
		if (n >= 0)
			handle(buf, n, &from);
	}
	return NULL;
}

void ckm_repair_start(void)
{
	pthread_mutex_lock(&g_mu);
	int first = !g_started;
	g_started = 1;
	pthread_mutex_unlock(&g_mu);
	if (!first || !g_cfg.repair_keep)
		return;
	g_at = now_s();
	struct sockaddr_in self = {.sin_family = AF_INET, .sin_addr = g_cfg.ip,
				   .sin_port = htons((uint16_t)g_cfg.repair_port)};
	int tos = TOS;
	g_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (g_fd < 0 || setsockopt(g_fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos) < 0 ||
	    bind(g_fd, (struct sockaddr *)&self, sizeof self) < 0 ||
	    pthread_create(&g_thread, NULL, serve, NULL) != 0) {
		say("repair: cannot serve on %s:%d (%m): a lost copy costs a re-seed",
		    inet_ntoa(g_cfg.ip), g_cfg.repair_port);
		if (g_fd >= 0)
			close(g_fd);
		g_fd = -1;
		return;
	}
}

__attribute__((destructor)) static void repair_stop(void)
{
	if (g_fd < 0)
		return;
	__atomic_store_n(&g_stop, 1, __ATOMIC_RELAXED);
	pthread_join(g_thread, NULL);
	close(g_fd);
	g_fd = -1;
	pthread_mutex_lock(&g_mu);
	for (size_t i = 0; i < g_n; i++)
		free(g_p[i].data);
	free(g_p);
	g_p = NULL;
	g_n = g_cap = 0;
	pthread_mutex_unlock(&g_mu);
	const char *path = getenv("CKM_NCCL_STATS");
	if (path && *path) { /* one JSON line of the service's counters, for the harness */
		FILE *f = fopen(path, "a");
		if (f) {
			fprintf(f, "{\"kind\": \"repair\", \"requests\": %llu, \"answered\": %llu, "
				"\"gone\": %llu, \"dropped\": %llu}\n", (unsigned long long)g_requests,
				(unsigned long long)g_answered, (unsigned long long)g_gone,
				(unsigned long long)g_dropped);
			fclose(f);
		}
	}
}
