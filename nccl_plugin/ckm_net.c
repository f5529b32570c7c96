/* The ckm NCCL network plugin: NCCL's point-to-point traffic as ckm datagrams over UDP,
 * reliable and ordered per connection, with each fully reduced ring chunk sent once with
 * REPLICATE so the switch copies it to its shadow (docs/nccl_plugin.md).
 *
 * Everything runs on the caller's thread: NCCL's proxy thread calls isend/irecv/test in a
 * loop, and each call moves its connection forward (receive acknowledgements, send what the
 * window allows, resend what timed out). No thread of our own, bounded memory per comm. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ckm_config.h"
#include "ckm_crypto.h"
#include "ckm_nccl_abi.h"
#include "ckm_plugin.h"
#include "ckm_prof.h"
#include "ckm_repair.h"
#include "ckm_sched.h"
#include "ckm_tuner.h"
#include "ckm_wire.h"

#define EXPORT __attribute__((visibility("default")))

#define WINDOW 256                 /* datagrams in flight per connection */
#define MAX_REQS 64                /* requests in flight per comm (NCCL needs 32) */
#define PAY_MAX CKM_MAX_PAYLOAD_JUMBO /* one 9000-byte frame: 9000 - IPv4 - UDP - ckm header */
#define REPL_ELEMS (PAY_MAX / 4)   /* float32 per REPLICATE piece: the switch copies frames */
#define DG_MAX (CKM_HEADER_LEN + PAY_MAX)
#define NACK_MAX 64
#define RTO 0.02                   /* seconds without acknowledgement before resending */
#define NACK_GAP 0.002
#define HANDLE_MAGIC 0x434b4d4eu   /* "CKMN" */
#define SOCK_BUF (4 << 20)
#define CKM_TOS 0x60               /* DSCP 24, the PFC lossless class (checkmate/control/pfc.py) */

enum { K_LISTEN = 1, K_SEND, K_RECV };

struct ckm_ctx {
	uint64_t comm_id;
	int index;   /* order of init calls in this process */
	int tagging; /* this communicator's allreduces follow the schedule model */
	int prof;    /* this communicator's isends are placed by their profiler step handle */
	ncclProfilerCallback_t prof_fn; /* NCCL's profiler callback, from init */
	int conns;   /* send connections made: connection k is channel k */
	int listens; /* listen comms made: listen k is channel k's receive side */
	/* This rank's ring index per channel as the ring itself proves it (-1: not yet): NCCL's
	 * index is the distance from rank 0 along the ring (init.cc, setupChannel); rank 0 is 0,
	 * and each rank learns it from its previous rank's plain datagrams, which carry the
	 * sender's index + 1 in fec_group (0: not known yet). */
	int ring_index[64];
	int checked; /* the first tagged isend's checks passed */
};

struct req {
	int used, kind, done;
	struct comm *c;
	char *buf;
	size_t size, pos;  /* send: bytes cut into datagrams; recv: bytes placed */
	int outstanding;   /* send: datagrams not yet acknowledged */
	int cut_all;
	uint32_t msg;
	int repl;          /* fully reduced: sent in REPLICATE pieces */
	uint64_t iteration, flat;
};

struct txslot {
	struct req *req;
	const char *data;
	uint32_t len;
	int live;
	double sent;
	struct ckm_hdr hdr;
};

struct stats {
	uint64_t sent, resent, acks, replicated, repl_elems, received, duplicate, foreign,
		malformed, corrupt, overflow;
};

struct comm {
	int kind, fd, fd_taken, failed;
	pthread_mutex_t mu;          /* the caller's thread and the progress thread */
	struct comm *next, *prev;    /* connected comms, for the progress thread */
	uint32_t token;
	struct ckm_ctx *ctx;
	struct stats st;
	struct req reqs[MAX_REQS];
	struct req *q[MAX_REQS]; /* send: requests still being cut; recv: posted receives */
	int qh, qn;
	uint32_t msg;
	/* listen: the UDP socket the accepted connection takes over, and a TCP listener for
	 * the setup exchange (TCP retransmits it, so setup survives a lossy path) */
	uint64_t listen_id;
	int accepted, tcp, peer_fd, got;
	uint8_t intro[24];
	double since;
	/* send */
	uint64_t tx_next, tx_base, tx_credit;
	double ack_at;
	struct txslot tx[WINDOW];
	int channel, peer_rank; /* peer_rank: the receiver's ring rank from its handle, or -1 */
	uint64_t coll, ci;
	/* recv */
	uint8_t *rx;
	uint32_t rxlen[WINDOW];
	uint8_t rxlive[WINDOW];
	uint64_t rx_cons, rx_next, rx_max, acked_next, acked_cons;
	int ack_due;
	double last_ack;
};

struct handle {
	uint32_t magic, ip;
	uint16_t udp_port, tcp_port;
	uint64_t listen_id;
	struct comm *pending; /* connect's state between NCCL's calls; NULL from the peer */
	int32_t rank;         /* the listener's ring rank (CKM_NCCL_RANK), -1 when not tagging */
};
_Static_assert(sizeof(struct handle) <= NCCL_NET_HANDLE_MAXSIZE, "handle size");

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
struct ckm_config g_cfg; /* ckm_plugin.h */
static int g_loaded; /* 1 ok, -1 refused */
static char g_err[400];
static ncclDebugLogger_t g_log;
static int g_inits;
static struct ckm_ctx g_v10_ctx;

/* One clear line on stderr and in NCCL's log. */
void say(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	fprintf(stderr, "ckm-nccl: %s\n", line);
	if (g_log)
		g_log(NCCL_LOG_WARN, CKM_NCCL_SUBSYS_NET, __FILE__, __LINE__, "ckm-nccl: %s", line);
}

static ncclResult_t fail(struct comm *c, ncclResult_t r, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static ncclResult_t fail(struct comm *c, ncclResult_t r, const char *fmt, ...)
{
	char line[400];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	if (!c->failed)
		say("%s", line);
	c->failed = 1;
	return r;
}

/* Tagging stops for the communicator, with one line; the transport carries on plain, so
 * NCCL keeps working and the shadows re-seed. A label the plugin cannot prove is never sent. */
static void refuse(struct ckm_ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void refuse(struct ckm_ctx *x, const char *fmt, ...)
{
	char line[400];
	va_list ap;
	if (!x || (!x->tagging && !x->prof))
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	x->tagging = x->prof = 0;
	say("not tagging communicator %d: %s; NCCL continues untagged (the shadows re-seed)",
	    x->index, line);
}

/* The running NCCL's version code from ncclGetVersion in the process (NCCL loaded this
 * library, so its symbols are there), or 0 when there is none. */
static int nccl_version(void)
{
	ncclResult_t (*get)(int *) = (ncclResult_t (*)(int *))dlsym(RTLD_DEFAULT, "ncclGetVersion");
	int v = 0;
	if (!get || get(&v) != ncclSuccess)
		return 0;
	return v;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rand64(void)
{
	uint64_t x = 0;
	if (getrandom(&x, sizeof x, 0) != sizeof x)
		x = (uint64_t)now_s() * 2654435761u ^ (uint64_t)getpid();
	return x;
}

ncclResult_t load_config(void)
{
	pthread_mutex_lock(&g_lock);
	if (!g_loaded)
		g_loaded = ckm_config_load(&g_cfg, g_err, sizeof g_err) ? -1 : 1;
	int ok = g_loaded;
	pthread_mutex_unlock(&g_lock);
	if (ok < 0) {
		say("refusing to start: %s", g_err);
		return ncclInvalidUsage;
	}
	return ncclSuccess;
}

/* ------------------------------------------------------------------ sockets */
static int open_udp(int bind_range, struct sockaddr_in *self)
{
	int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	int sz = SOCK_BUF;
	setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
	setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
	int tos = CKM_TOS;
	if (setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos) < 0) {
		close(fd);
		return -1;
	}
	memset(self, 0, sizeof *self);
	self->sin_family = AF_INET;
	self->sin_addr = g_cfg.ip;
	/* Receivers take a port in the ckm range, so the switch parses what is sent to them. */
	int tries = bind_range ? g_cfg.port_count : 1;
	int start = bind_range ? (int)(rand64() % (uint64_t)g_cfg.port_count) : 0;
	for (int i = 0; i < tries; i++) {
		self->sin_port = bind_range
			? htons((uint16_t)(g_cfg.port_base + (start + i) % g_cfg.port_count)) : 0;
		if (bind(fd, (struct sockaddr *)self, sizeof *self) == 0) {
			socklen_t l = sizeof *self;
			getsockname(fd, (struct sockaddr *)self, &l);
			return fd;
		}
		if (errno != EADDRINUSE)
			break;
	}
	close(fd);
	return -1;
}

static void fill_hdr(struct ckm_hdr *h, uint8_t flags, uint32_t token, uint64_t iteration,
		     uint64_t offset, uint32_t count, uint32_t seq, uint16_t bucket,
		     uint16_t partition, uint8_t dtype, uint32_t crc)
{
	memset(h, 0, sizeof *h);
	h->magic = htons(CKM_MAGIC);
	h->version = CKM_VERSION;
	h->flags = flags;
	h->job_id = htonl(g_cfg.job);
	h->token = htonl(token);
	h->iteration = htobe64(iteration);
	h->offset = htobe64(offset);
	h->count = htonl(count);
	h->seq = htonl(seq);
	h->bucket = htons(bucket);
	h->partition = htons(partition);
	h->dtype = dtype;
	h->crc32c = htonl(crc);
}

static int dtype_size(uint8_t dt)
{
	switch (dt) {
	case CKM_DT_FLOAT32: return CKM_DT_FLOAT32_SIZE;
	case CKM_DT_BFLOAT16: return CKM_DT_BFLOAT16_SIZE;
	case CKM_DT_FLOAT16: return CKM_DT_FLOAT16_SIZE;
	case CKM_DT_BYTES: return CKM_DT_BYTES_SIZE;
	}
	return 0;
}

/* Checks a received datagram of this session; 0 = take it, else it was counted. */
static int check_dgram(struct comm *c, const uint8_t *buf, ssize_t n, struct ckm_hdr *h)
{
	if (n < CKM_HEADER_LEN) {
		c->st.malformed++;
		return -1;
	}
	memcpy(h, buf, sizeof *h);
	int sz = dtype_size(h->dtype);
	if (ntohs(h->magic) != CKM_MAGIC || h->version != CKM_VERSION || !sz ||
	    (uint64_t)ntohl(h->count) * sz != (uint64_t)(n - CKM_HEADER_LEN)) {
		c->st.malformed++;
		return -1;
	}
	if (ntohl(h->job_id) != g_cfg.job || ntohl(h->token) != c->token) {
		c->st.foreign++;
		return -1;
	}
	if (ckm_crc32c(buf + CKM_HEADER_LEN, (size_t)(n - CKM_HEADER_LEN)) != ntohl(h->crc32c)) {
		c->st.corrupt++;
		return -1;
	}
	return 0;
}

/* The 64-bit sequence number nearest `base` whose low 32 bits are `s`. */
static uint64_t unwrap(uint64_t base, uint32_t s)
{
	uint64_t cand = (base & ~0xFFFFFFFFull) | s;
	if (cand + 0x80000000ull < base)
		cand += 0x100000000ull;
	else if (cand > base + 0x80000000ull && cand >= 0x100000000ull)
		cand -= 0x100000000ull;
	return cand;
}

/* ------------------------------------------------------------------ sender */
static int transmit(struct comm *c, struct txslot *s)
{
	struct iovec iov[2] = {{&s->hdr, CKM_HEADER_LEN}, {(void *)s->data, s->len}};
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = s->len ? 2 : 1};
	if (sendmsg(c->fd, &m, MSG_DONTWAIT) < 0) {
		if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED ||
		    errno == EINTR || errno == ENOBUFS)
			return 0; /* resent on the timer */
		return -1;
	}
	return 1;
}

/* The partition owning flat element x: [i*total//n, (i+1)*total//n) (checkmate/spec/partition.py). */
static int owner(uint64_t x, uint64_t *hi)
{
	uint64_t t = g_cfg.total, n = (uint64_t)g_cfg.partitions;
	uint64_t p = (uint64_t)((unsigned __int128)x * n / t);
	if (p >= n)
		p = n - 1;
	while (p > 0 && (unsigned __int128)p * t / n > x)
		p--;
	while ((unsigned __int128)(p + 1) * t / n <= x)
		p++;
	*hi = (uint64_t)((unsigned __int128)(p + 1) * t / n);
	return (int)p;
}

static ncclResult_t queue_slot(struct comm *c, struct txslot *s)
{
	double t = now_s();
	if (c->tx_base == c->tx_next)
		c->ack_at = t; /* the acknowledgement clock starts with the first datagram out */
	s->live = 1;
	s->sent = t;
	c->tx_next++;
	c->st.sent++;
	if (transmit(c, s) < 0)
		return fail(c, ncclSystemError, "send to the next rank failed: %s", strerror(errno));
	return ncclSuccess;
}

/* Cut queued send requests into datagrams while the window and the receiver's credit allow. */
static ncclResult_t cut(struct comm *c)
{
	while (c->qn && c->tx_next - c->tx_base < WINDOW && c->tx_next < c->tx_credit) {
		struct req *r = c->q[c->qh];
		struct txslot *s = &c->tx[c->tx_next % WINDOW];
		size_t len;
		uint8_t flags = 0, dtype = CKM_DT_BYTES;
		uint64_t iteration = 0, offset = r->pos;
		uint16_t part = 0;
		if (r->repl) {
			uint64_t flat = r->flat + r->pos / 4, hi;
			part = (uint16_t)owner(flat, &hi);
			uint64_t elems = (r->size - r->pos) / 4;
			if (elems > REPL_ELEMS)
				elems = REPL_ELEMS;
			if (elems > hi - flat)
				elems = hi - flat;
			len = elems * 4;
			flags = CKM_F_REPLICATE;
			dtype = CKM_DT_FLOAT32;
			iteration = r->iteration;
			offset = flat;
		} else {
			len = r->size - r->pos < PAY_MAX ? r->size - r->pos : PAY_MAX;
		}
		int last = r->pos + len == r->size;
		if (last)
			flags |= CKM_F_LAST;
		uint32_t count = (uint32_t)(dtype == CKM_DT_FLOAT32 ? len / 4 : len);
		uint32_t crc = ckm_crc32c(r->buf + r->pos, len);
		fill_hdr(&s->hdr, flags, c->token, iteration, offset, count, (uint32_t)c->tx_next,
			 (uint16_t)r->msg, part, dtype, crc);
		if (r->repl) {
			uint64_t tag = ckm_data_tag(g_cfg.k0, g_cfg.k1, g_cfg.job, flags, part, dtype,
						    iteration, offset, count, crc);
			s->hdr.fec_index = (uint8_t)(tag >> 48);
			s->hdr.fec_k = (uint8_t)(tag >> 40);
			s->hdr.fec_m = (uint8_t)(tag >> 32);
			s->hdr.fec_group = htonl((uint32_t)tag);
			c->st.replicated++;
			c->st.repl_elems += count;
			ckm_repair_retain(iteration, offset, count, part, (uint16_t)r->msg,
					  r->buf + r->pos);
		}
		int ix = c->ctx && c->channel >= 0 && c->channel < 64
			? __atomic_load_n(&c->ctx->ring_index[c->channel], __ATOMIC_RELAXED) : -1;
		if (!r->repl && ix >= 0) /* tell the next rank where we are */
			s->hdr.fec_group = htonl((uint32_t)ix + 1);
		s->req = r;
		s->data = r->buf + r->pos;
		s->len = (uint32_t)len;
		r->pos += len;
		r->outstanding++;
		if (last) {
			r->cut_all = 1;
			c->qh = (c->qh + 1) % MAX_REQS;
			c->qn--;
		}
		ncclResult_t res = queue_slot(c, s);
		if (res != ncclSuccess)
			return res;
	}
	return ncclSuccess;
}

static void release_acked(struct comm *c, uint64_t cum)
{
	while (c->tx_base < cum) {
		struct txslot *s = &c->tx[c->tx_base % WINDOW];
		if (s->live && s->req && --s->req->outstanding == 0 && s->req->cut_all)
			s->req->done = 1;
		s->live = 0;
		c->tx_base++;
	}
}

static ncclResult_t resend(struct comm *c, struct txslot *s, double t)
{
	s->sent = t;
	c->st.resent++;
	if (transmit(c, s) < 0)
		return fail(c, ncclSystemError, "resend to the next rank failed: %s", strerror(errno));
	return ncclSuccess;
}

static ncclResult_t progress_send(struct comm *c)
{
	uint8_t buf[DG_MAX];
	struct ckm_hdr h;
	ncclResult_t res;
	for (int k = 0; k < 256; k++) {
		ssize_t n = recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
		if (n < 0)
			break;
		if (check_dgram(c, buf, n, &h))
			continue;
		if (!(h.flags & CKM_F_ACK)) {
			c->st.malformed++;
			continue;
		}
		c->st.acks++;
		uint64_t cum = unwrap(c->tx_base, ntohl(h.seq));
		uint64_t cons = be64toh(h.offset);
		if (cum > c->tx_next || cum < c->tx_base || cons > cum) {
			c->st.malformed++; /* stale or bogus: never frees what was not received */
			continue;
		}
		if (cum > c->tx_base)
			c->ack_at = now_s();
		release_acked(c, cum);
		if (cons + WINDOW > c->tx_credit)
			c->tx_credit = cons + WINDOW;
		double t = now_s();
		uint32_t cnt = ntohl(h.count);
		for (uint32_t i = 0; (h.flags & CKM_F_NACK) && i + 4 <= cnt; i += 4) {
			uint32_t s32;
			memcpy(&s32, buf + CKM_HEADER_LEN + i, 4);
			uint64_t seq = unwrap(c->tx_base, ntohl(s32));
			if (seq < c->tx_base || seq >= c->tx_next)
				continue;
			struct txslot *s = &c->tx[seq % WINDOW];
			if (s->live && t - s->sent >= NACK_GAP && (res = resend(c, s, t)))
				return res;
		}
	}
	if ((res = cut(c)))
		return res;
	if (c->tx_base == c->tx_next)
		return ncclSuccess;
	double t = now_s();
	struct txslot *first = &c->tx[c->tx_base % WINDOW];
	if (t - (first->sent > c->ack_at ? first->sent : c->ack_at) >= RTO) {
		for (uint64_t seq = c->tx_base; seq < c->tx_next && seq < c->tx_base + 64; seq++) {
			struct txslot *s = &c->tx[seq % WINDOW];
			if (s->live && t - s->sent >= RTO && (res = resend(c, s, t)))
				return res;
		}
	}
	if (t - c->ack_at > g_cfg.timeout_s)
		return fail(c, ncclRemoteError, "no acknowledgement from the next rank for %.0f s "
			    "(CKM_NCCL_TIMEOUT): the peer is gone", g_cfg.timeout_s);
	return ncclSuccess;
}

/* ------------------------------------------------------------------ receiver */
static void send_ack(struct comm *c, double t)
{
	uint8_t pay[NACK_MAX * 4] = {0};
	uint32_t n = 0;
	for (uint64_t s = c->rx_next; s < c->rx_max && n < NACK_MAX; s++)
		if (!c->rxlive[s % WINDOW]) {
			uint32_t be = htonl((uint32_t)s);
			memcpy(pay + 4 * n++, &be, 4);
		}
	struct txslot a;
	fill_hdr(&a.hdr, CKM_F_ACK | (n ? CKM_F_NACK : 0), c->token, 0, c->rx_cons, 4 * n,
		 (uint32_t)c->rx_next, 0, 0, CKM_DT_BYTES, ckm_crc32c(pay, 4 * n));
	a.data = (const char *)pay;
	a.len = 4 * n;
	if (transmit(c, &a) > 0) {
		c->st.acks++;
		c->acked_next = c->rx_next;
		c->acked_cons = c->rx_cons;
		c->ack_due = 0;
		c->last_ack = t;
	}
}

/* The communicator CKM_NCCL_COMM selects (the order of net init calls). */
static int selected_index(void)
{
	const char *which = getenv("CKM_NCCL_COMM");
	return which && *which ? atoi(which) : 0;
}

/* A plain datagram from the previous rank names its ring index (see ckm_ctx.ring_index). */
static void learn_index(struct comm *c, const struct ckm_hdr *h)
{
	struct ckm_ctx *x = c->ctx;
	uint32_t v = ntohl(h->fec_group);
	/* learned and passed on even where this rank refused: the next ranks need it */
	if (!x || !g_cfg.tagging || x->index != selected_index() || (h->flags & CKM_F_REPLICATE) ||
	    !v || c->channel < 0 || c->channel >= 64)
		return;
	int n = g_cfg.sched.nranks, mine = (int)((v - 1 + 1) % (uint32_t)n);
	if (v > (uint32_t)n) {
		refuse(x, "a ring index %u from the previous rank on channel %d", v - 1, c->channel);
		return;
	}
	int none = -1; /* the receive and send sides run on different threads */
	__atomic_compare_exchange_n(&x->ring_index[c->channel], &none, mine, 0, __ATOMIC_RELAXED,
				    __ATOMIC_RELAXED);
	if (__atomic_load_n(&x->ring_index[c->channel], __ATOMIC_RELAXED) != mine ||
	    mine != g_cfg.sched.rank)
		refuse(x, "its ring on channel %d puts this rank %d at index %d (the distance from "
		       "rank 0); the schedule needs the rank order", c->channel, g_cfg.sched.rank,
		       mine);
}

static ncclResult_t deliver(struct comm *c)
{
	while (c->qn && c->rxlive[c->rx_cons % WINDOW]) {
		struct req *r = c->q[c->qh];
		uint8_t *d = c->rx + (c->rx_cons % WINDOW) * DG_MAX;
		struct ckm_hdr h;
		memcpy(&h, d, sizeof h);
		uint32_t len = c->rxlen[c->rx_cons % WINDOW] - CKM_HEADER_LEN;
		if (ntohs(h.bucket) != (uint16_t)r->msg)
			return fail(c, ncclInternalError, "datagram of message %u where message %u was "
				    "expected: the connection lost its order", ntohs(h.bucket),
				    (uint16_t)r->msg);
		if (r->pos + len > r->size)
			return fail(c, ncclInternalError, "a message of more than %zu bytes for a "
				    "receive of %zu", r->pos + len, r->size);
		learn_index(c, &h);
		memcpy(r->buf + r->pos, d + CKM_HEADER_LEN, len);
		r->pos += len;
		c->rxlive[c->rx_cons % WINDOW] = 0;
		c->rx_cons++;
		if (h.flags & CKM_F_LAST) {
			r->done = 1;
			c->qh = (c->qh + 1) % MAX_REQS;
			c->qn--;
		}
	}
	return ncclSuccess;
}

static ncclResult_t progress_recv(struct comm *c)
{
	struct ckm_hdr h;
	for (int k = 0; k < 256; k++) {
		uint8_t *tmp = c->rx + WINDOW * DG_MAX; /* spare slot */
		ssize_t n = recv(c->fd, tmp, DG_MAX, MSG_DONTWAIT);
		if (n < 0)
			break;
		if (check_dgram(c, tmp, n, &h))
			continue;
		if (h.flags & (CKM_F_ACK | CKM_F_NACK)) {
			c->st.malformed++;
			continue;
		}
		uint64_t seq = unwrap(c->rx_cons, ntohl(h.seq));
		if (seq < c->rx_cons || c->rxlive[seq % WINDOW]) {
			c->st.duplicate++;
			c->ack_due = 1;
			continue;
		}
		if (seq >= c->rx_cons + WINDOW) {
			c->st.overflow++; /* beyond the credit we gave: resent later */
			continue;
		}
		c->st.received++;
		memcpy(c->rx + (seq % WINDOW) * DG_MAX, tmp, (size_t)n);
		c->rxlen[seq % WINDOW] = (uint32_t)n;
		c->rxlive[seq % WINDOW] = 1;
		if (seq + 1 > c->rx_max)
			c->rx_max = seq + 1;
		while (c->rx_next < c->rx_cons + WINDOW && c->rxlive[c->rx_next % WINDOW])
			c->rx_next++;
	}
	ncclResult_t res = deliver(c);
	if (res)
		return res;
	double t = now_s();
	int changed = c->rx_next != c->acked_next || c->rx_cons != c->acked_cons;
	int gaps = c->rx_max > c->rx_next;
	/* A posted receive waiting for data re-announces its credit: a lost ACK cannot stall. */
	if (changed || c->ack_due || ((gaps || c->qn) && t - c->last_ack >= (gaps ? NACK_GAP : RTO)))
		send_ack(c, t);
	return ncclSuccess;
}

/* ------------------------------------------------------------------ progress thread
 * NCCL stops calling test() on a connection once its requests are done, but a peer may
 * still need our acknowledgement (its last ACK was lost) or our resend. One thread per
 * process keeps every connected comm moving every 2 ms; it exits when none is left, and a
 * destructor joins it before the library is unloaded. */
static pthread_mutex_t g_list = PTHREAD_MUTEX_INITIALIZER;
static struct comm *g_comms;
static pthread_t g_thread;
static int g_thread_on, g_thread_joinable, g_stop;

static ncclResult_t progress_send(struct comm *c);
static ncclResult_t progress_recv(struct comm *c);

static void *progress_main(void *arg)
{
	(void)arg;
	for (;;) {
		pthread_mutex_lock(&g_list);
		if (!g_comms || g_stop) {
			g_thread_on = 0;
			pthread_mutex_unlock(&g_list);
			return NULL;
		}
		for (struct comm *c = g_comms; c; c = c->next)
			if (!c->failed && pthread_mutex_trylock(&c->mu) == 0) {
				if (c->kind == K_SEND)
					progress_send(c);
				else
					progress_recv(c);
				pthread_mutex_unlock(&c->mu);
			}
		pthread_mutex_unlock(&g_list);
		usleep(2000);
	}
}

static void track(struct comm *c)
{
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_lock(&g_list);
	c->next = g_comms;
	if (g_comms)
		g_comms->prev = c;
	g_comms = c;
	if (!g_thread_on) {
		if (g_thread_joinable)
			pthread_join(g_thread, NULL); /* it already left its loop */
		g_thread_joinable = g_thread_on = pthread_create(&g_thread, NULL, progress_main, NULL) == 0;
		if (!g_thread_on)
			say("could not start the progress thread: a lost final acknowledgement will "
			    "stall until CKM_NCCL_TIMEOUT");
	}
	pthread_mutex_unlock(&g_list);
}

static void untrack(struct comm *c)
{
	pthread_mutex_lock(&g_list);
	pthread_mutex_lock(&c->mu); /* the thread is not inside it */
	if (c->prev)
		c->prev->next = c->next;
	else
		g_comms = c->next;
	if (c->next)
		c->next->prev = c->prev;
	pthread_mutex_unlock(&c->mu);
	pthread_mutex_unlock(&g_list);
	pthread_mutex_destroy(&c->mu);
}

__attribute__((destructor)) static void stop_thread(void)
{
	pthread_mutex_lock(&g_list);
	g_stop = 1;
	int join = g_thread_joinable;
	g_thread_joinable = 0;
	pthread_mutex_unlock(&g_list);
	if (join)
		pthread_join(g_thread, NULL);
}

/* ------------------------------------------------------------------ the interface */
static ncclResult_t ckm_devices(int *ndev)
{
	*ndev = 1;
	return ncclSuccess;
}

static void props(ncclNetProperties_v12_t *p)
{
	static char name[] = "ckm0";
	memset(p, 0, sizeof *p);
	p->name = name;
	p->pciPath = NULL;
	p->guid = 0x636b6d00; /* "ckm" */
	p->ptrSupport = NCCL_PTR_HOST;
	p->speed = 100000;
	p->maxComms = 65536;
	p->maxRecvs = 1;
	p->netDeviceType = NCCL_NET_DEVICE_HOST;
	p->vProps.ndevs = 1;
	p->vProps.devs[0] = 0;
	p->maxP2pBytes = CKM_NCCL_MAX_NET_SIZE;
	p->maxCollBytes = CKM_NCCL_MAX_NET_SIZE;
	p->maxMultiRequestSize = 1;
	p->railId = NCCL_NET_ID_UNDEF;
	p->planeId = NCCL_NET_ID_UNDEF;
}

static ncclResult_t ckm_get_properties_v12(int dev, ncclNetProperties_v12_t *p)
{
	if (dev != 0)
		return ncclInvalidArgument;
	props(p);
	return ncclSuccess;
}

static ncclResult_t ckm_get_properties_v11(int dev, ncclNetProperties_v11_t *p)
{
	ncclNetProperties_v12_t q;
	if (dev != 0)
		return ncclInvalidArgument;
	props(&q);
	memset(p, 0, sizeof *p);
	memcpy(p, &q, offsetof(ncclNetProperties_v11_t, vProps));
	p->vProps.ndevs = q.vProps.ndevs;
	p->vProps.devs[0] = q.vProps.devs[0];
	p->maxP2pBytes = q.maxP2pBytes;
	p->maxCollBytes = q.maxCollBytes;
	p->maxMultiRequestSize = q.maxMultiRequestSize;
	return ncclSuccess;
}

static ncclResult_t ckm_get_properties_v10(int dev, ncclNetProperties_v10_t *p)
{
	ncclNetProperties_v11_t q;
	ncclResult_t r = ckm_get_properties_v11(dev, &q);
	if (r == ncclSuccess)
		memcpy(p, &q, sizeof *p);
	return r;
}

static ncclResult_t ckm_init(void **ctx, uint64_t commId, ncclNetCommConfig_t *config,
			     ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction)
{
	(void)config;
	if (logFunction)
		g_log = logFunction;
	ncclResult_t r = load_config();
	if (r)
		return r;
	struct ckm_ctx *x = calloc(1, sizeof *x);
	if (!x)
		return ncclSystemError;
	x->comm_id = commId;
	x->prof_fn = profFunction;
	x->index = __atomic_fetch_add(&g_inits, 1, __ATOMIC_RELAXED);
	const char *which = getenv("CKM_NCCL_COMM");
	int selected = g_cfg.tagging && x->index == (which && *which ? atoi(which) : 0);
	x->tagging = selected && g_cfg.identity == CKM_IDENTITY_MODEL;
	x->prof = selected && g_cfg.identity == CKM_IDENTITY_PROFILER;
	for (int i = 0; i < 64; i++)
		x->ring_index[i] = g_cfg.tagging && g_cfg.sched.rank == 0 ? 0 : -1;
	*ctx = x;
	if (!selected)
		return ncclSuccess;
	/* The schedule is release specific: learn the release, refuse any not checked. */
	int v = nccl_version();
	g_cfg.sched.release = ckm_sched_release(v);
	if (!v)
		refuse(x, "ncclGetVersion is not in this process, so the NCCL release and its ring "
		       "schedule are unknown");
	else if (g_cfg.sched.release == CKM_REL_NONE)
		refuse(x, "NCCL %d.%d.%d is not a release whose ring schedule was checked (%s)",
		       v / 10000, v / 100 % 100, v % 100, ckm_sched_supported());
	else if (x->prof && g_cfg.sched.release == CKM_REL_2_28)
		refuse(x, "CKM_NCCL_IDENTITY=profiler needs profiler v6 (NCCL 2.29+); NCCL %d.%d.%d "
		       "has v5: use CKM_NCCL_IDENTITY=model", v / 10000, v / 100 % 100, v % 100);
	if (x->tagging || x->prof)
		ckm_repair_start();
	return ncclSuccess;
}

static ncclResult_t ckm_finalize(void *ctx)
{
	if (ctx != &g_v10_ctx)
		free(ctx);
	return ncclSuccess;
}

static ncclResult_t ckm_set_net_attr(void *ctx, ncclNetAttr_t *attr)
{
	(void)ctx;
	(void)attr; /* one transport behaviour for every operation */
	return ncclSuccess;
}

static ncclResult_t ckm_listen(void *ctx, int dev, void *handle, void **listenComm)
{
	struct sockaddr_in self, tself = {.sin_family = AF_INET};
	socklen_t tl = sizeof tself;
	if (dev != 0)
		return ncclInvalidArgument;
	struct comm *c = calloc(1, sizeof *c);
	if (!c)
		return ncclSystemError;
	c->fd = open_udp(1, &self);
	if (c->fd < 0) {
		free(c);
		say("no free UDP port in %d..%d on %s: %s", g_cfg.port_base,
		    g_cfg.port_base + g_cfg.port_count - 1, inet_ntoa(g_cfg.ip), strerror(errno));
		return ncclSystemError;
	}
	c->tcp = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int tos = CKM_TOS;
	if (c->tcp >= 0)
		setsockopt(c->tcp, IPPROTO_IP, IP_TOS, &tos, sizeof tos);
	tself.sin_addr = g_cfg.ip;
	if (c->tcp < 0 || bind(c->tcp, (struct sockaddr *)&tself, sizeof tself) < 0 ||
	    listen(c->tcp, 16) < 0 || getsockname(c->tcp, (struct sockaddr *)&tself, &tl) < 0) {
		say("listen: TCP setup socket on %s: %s", inet_ntoa(g_cfg.ip), strerror(errno));
		if (c->tcp >= 0)
			close(c->tcp);
		close(c->fd);
		free(c);
		return ncclSystemError;
	}
	c->kind = K_LISTEN;
	c->ctx = ctx;
	if (ctx)
		c->channel = ((struct ckm_ctx *)ctx)->listens++;
	c->peer_fd = -1;
	c->listen_id = rand64();
	struct handle hd = {htonl(HANDLE_MAGIC), self.sin_addr.s_addr, self.sin_port,
			    tself.sin_port, htobe64(c->listen_id), NULL,
			    (int32_t)htonl((uint32_t)(g_cfg.tagging ? g_cfg.sched.rank : -1))};
	memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
	memcpy(handle, &hd, sizeof hd);
	*listenComm = c;
	return ncclSuccess;
}

static void free_comm(struct comm *c)
{
	if (c->fd >= 0)
		close(c->fd);
	if (c->peer_fd >= 0)
		close(c->peer_fd);
	free(c->rx);
	free(c);
}

/* Setup exchange, sender side: TCP to the listener, 24 bytes {magic, listen id, token, UDP
 * port, address}, then one byte back once the receiver is ready. Never blocks: returns
 * *sendComm = NULL until done, keeping its state in the handle as NCCL's own plugins do. */
static ncclResult_t ckm_connect(void *ctx, int dev, void *handle, void **sendComm,
				ncclNetDeviceHandle_t **sendDevComm)
{
	struct handle hd;
	struct ckm_ctx *x = ctx;
	(void)sendDevComm;
	*sendComm = NULL;
	if (dev != 0)
		return ncclInvalidArgument;
	memcpy(&hd, handle, sizeof hd);
	if (ntohl(hd.magic) != HANDLE_MAGIC) {
		say("connect: the handle is not a ckm handle (another plugin on the peer?)");
		return ncclInvalidUsage;
	}
	struct comm *c = hd.pending;
	if (!c) {
		struct sockaddr_in self, peer = {.sin_family = AF_INET}, tself = {.sin_family = AF_INET};
		if (x->conns >= g_cfg.sched.channels)
			refuse(x, "NCCL opened send connection %d where CKM_NCCL_CHANNELS is %d, so "
			       "connections are not channels", x->conns + 1, g_cfg.sched.channels);
		int peer_rank = (int)ntohl((uint32_t)hd.rank), next = -1;
		if (g_cfg.tagging)
			next = (g_cfg.sched.rank + 1) % g_cfg.sched.nranks;
		if ((x->tagging || x->prof) && peer_rank != next)
			refuse(x, "its ring sends to rank %d where the schedule needs the next rank %d "
			       "(ring order = rank order)", peer_rank, next);
		if (!(c = calloc(1, sizeof *c)))
			return ncclSystemError;
		c->peer_fd = -1;
		c->fd = open_udp(0, &self);
		peer.sin_addr.s_addr = hd.ip;
		peer.sin_port = hd.udp_port;
		tself.sin_addr = g_cfg.ip;
		if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&peer, sizeof peer) < 0 ||
		    (c->peer_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0 ||
		    setsockopt(c->peer_fd, IPPROTO_IP, IP_TOS, &(int){CKM_TOS}, sizeof(int)) < 0 ||
		    bind(c->peer_fd, (struct sockaddr *)&tself, sizeof tself) < 0) {
			say("connect to %s: %s", inet_ntoa(peer.sin_addr), strerror(errno));
			free_comm(c);
			return ncclSystemError;
		}
		peer.sin_port = hd.tcp_port;
		if (connect(c->peer_fd, (struct sockaddr *)&peer, sizeof peer) < 0 &&
		    errno != EINPROGRESS) {
			say("connect to %s: %s", inet_ntoa(peer.sin_addr), strerror(errno));
			free_comm(c);
			return ncclSystemError;
		}
		c->kind = K_SEND;
		c->ctx = x;
		c->token = (uint32_t)rand64();
		c->tx_credit = WINDOW;
		c->channel = x->conns++;
		c->peer_rank = peer_rank;
		c->since = now_s();
		uint32_t m = htonl(HANDLE_MAGIC), tok = htonl(c->token), ip = self.sin_addr.s_addr;
		uint16_t port = self.sin_port, pad = 0;
		memcpy(c->intro, &m, 4);
		memcpy(c->intro + 4, &hd.listen_id, 8);
		memcpy(c->intro + 12, &tok, 4);
		memcpy(c->intro + 16, &ip, 4);
		memcpy(c->intro + 20, &port, 2);
		memcpy(c->intro + 22, &pad, 2);
		hd.pending = c;
		memcpy(handle, &hd, sizeof hd);
		return ncclSuccess;
	}
	struct pollfd p = {c->peer_fd, c->got < 24 ? POLLOUT : POLLIN, 0};
	if (poll(&p, 1, 0) > 0) {
		int err = 0;
		socklen_t el = sizeof err;
		getsockopt(c->peer_fd, SOL_SOCKET, SO_ERROR, &err, &el);
		ssize_t n;
		uint8_t ok = 0;
		if (err) {
			errno = err;
			n = -1;
		} else if (c->got < 24) {
			n = send(c->peer_fd, c->intro + c->got, (size_t)(24 - c->got), MSG_NOSIGNAL);
			if (n > 0)
				c->got += (int)n;
		} else {
			n = recv(c->peer_fd, &ok, 1, 0);
			if (n == 1 && ok == 1) {
				close(c->peer_fd);
				c->peer_fd = -1;
				hd.pending = NULL;
				memcpy(handle, &hd, sizeof hd);
				track(c);
				*sendComm = c;
				return ncclSuccess;
			}
			if (n == 0)
				errno = ECONNRESET;
		}
		if (n <= 0 && errno != EAGAIN && errno != EINTR) {
			say("connect: setup exchange with the next rank failed: %s", strerror(errno));
			free_comm(c);
			hd.pending = NULL;
			memcpy(handle, &hd, sizeof hd);
			return ncclRemoteError;
		}
	}
	if (now_s() - c->since > g_cfg.timeout_s) {
		say("connect: no answer from the peer for %.0f s (CKM_NCCL_TIMEOUT)", g_cfg.timeout_s);
		free_comm(c);
		hd.pending = NULL;
		memcpy(handle, &hd, sizeof hd);
		return ncclRemoteError;
	}
	return ncclSuccess;
}

/* Receiver side of the setup exchange: *recvComm = NULL until a sender that knows this
 * listen id introduced itself (NCCL calls again). Anything else is dropped and counted. */
static ncclResult_t ckm_accept(void *listenComm, void **recvComm,
			       ncclNetDeviceHandle_t **recvDevComm)
{
	struct comm *l = listenComm;
	(void)recvDevComm;
	*recvComm = NULL;
	if (l->accepted) {
		say("accept called twice on one listen handle: NCCL opens one connection per listen");
		return ncclInvalidUsage;
	}
	if (l->peer_fd < 0) {
		l->peer_fd = accept4(l->tcp, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (l->peer_fd < 0)
			return ncclSuccess;
		l->got = 0;
		l->since = now_s();
	}
	ssize_t n = recv(l->peer_fd, l->intro + l->got, (size_t)(24 - l->got), 0);
	if (n > 0)
		l->got += (int)n;
	int bad = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR) ||
		  now_s() - l->since > 10.0;
	uint32_t m, tok, ip;
	uint64_t id;
	uint16_t port;
	if (!bad && l->got < 24)
		return ncclSuccess;
	if (!bad) {
		memcpy(&m, l->intro, 4);
		memcpy(&id, l->intro + 4, 8);
		memcpy(&tok, l->intro + 12, 4);
		memcpy(&ip, l->intro + 16, 4);
		memcpy(&port, l->intro + 20, 2);
		bad = ntohl(m) != HANDLE_MAGIC || be64toh(id) != l->listen_id;
	}
	if (bad) {
		l->st.foreign++; /* not our peer: drop it, keep listening */
		close(l->peer_fd);
		l->peer_fd = -1;
		return ncclSuccess;
	}
	struct sockaddr_in src = {.sin_family = AF_INET, .sin_port = port};
	src.sin_addr.s_addr = ip;
	struct comm *c = calloc(1, sizeof *c);
	uint8_t *rx = malloc((size_t)(WINDOW + 1) * DG_MAX);
	uint8_t ok = 1;
	if (!c || !rx || connect(l->fd, (struct sockaddr *)&src, sizeof src) < 0 ||
	    send(l->peer_fd, &ok, 1, MSG_NOSIGNAL) != 1) {
		say("accept: %s", strerror(errno ? errno : ENOMEM));
		free(c);
		free(rx);
		return ncclSystemError;
	}
	close(l->peer_fd);
	l->peer_fd = -1;
	c->kind = K_RECV;
	c->ctx = l->ctx;
	c->channel = l->channel;
	c->fd = l->fd;
	c->peer_fd = -1;
	l->fd_taken = 1;
	l->accepted = 1;
	c->rx = rx;
	c->token = ntohl(tok);
	c->st.foreign = l->st.foreign;
	track(c);
	*recvComm = c;
	return ncclSuccess;
}

static ncclResult_t ckm_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle)
{
	(void)comm;
	(void)data;
	(void)size;
	if (type != NCCL_PTR_HOST) {
		say("regMr of memory type %d: this plugin moves host memory only (NCCL_PTR_HOST)", type);
		return ncclInternalError;
	}
	*mhandle = NULL;
	return ncclSuccess;
}

static ncclResult_t ckm_reg_mr_dmabuf(void *comm, void *data, size_t size, int type,
				      uint64_t offset, int fd, void **mhandle)
{
	(void)offset;
	(void)fd; /* DMA-BUF is device memory: refused like any type but host */
	return ckm_reg_mr(comm, data, size, type, mhandle);
}

static ncclResult_t ckm_dereg_mr(void *comm, void *mhandle)
{
	(void)comm;
	(void)mhandle;
	return ncclSuccess;
}

static struct req *new_req(struct comm *c, int kind)
{
	if (c->qn == MAX_REQS)
		return NULL;
	for (int i = 0; i < MAX_REQS; i++)
		if (!c->reqs[i].used) {
			struct req *r = &c->reqs[i];
			memset(r, 0, sizeof *r);
			r->used = 1;
			r->kind = kind;
			r->c = c;
			return r;
		}
	return NULL;
}

/* What must hold before the first label of a communicator (docs/nccl_plugin.md, "What the
 * plugin proves"): NCCL passes the sender's own rank as the isend tag (net.cc:1342), the
 * ckm tuner pinned Ring/Simple and the channel count, and every channel is connected. */
static int first_checks(struct comm *c, int tag)
{
	struct ckm_ctx *x = c->ctx;
	const char *why = NULL;
	if (tag != g_cfg.sched.rank) {
		refuse(x, "isend tag %d is not this rank %d: the communicator is not the one "
		       "CKM_NCCL_RANK describes (NCCL tags with the sender's own top-parent rank)",
		       tag, g_cfg.sched.rank);
		return 0;
	}
	if (!ckm_tuner_pinned(x->comm_id, &why)) { /* every isend: the tuner sees each coll */
		refuse(x, "%s", why);
		return 0;
	}
	if (x->checked)
		return 1;
	if (x->conns != g_cfg.sched.channels) {
		refuse(x, "it has %d channels where CKM_NCCL_CHANNELS is %d", x->conns,
		       g_cfg.sched.channels);
		return 0;
	}
	x->checked = 1;
	return 1;
}

/* The ring has shown this rank its index on the connection's channel (before the first
 * fully reduced send a receive on that channel has completed, so it has had the chance). */
static int index_proven(struct comm *c)
{
	int ix = c->channel >= 0 && c->channel < 64
		? __atomic_load_n(&c->ctx->ring_index[c->channel], __ATOMIC_RELAXED) : -1;
	if (ix == g_cfg.sched.rank)
		return 1;
	refuse(c->ctx, "its ring position on channel %d is not proven yet (no ring index from the "
	       "previous rank before the first fully reduced send)", c->channel);
	return 0;
}

/* Where the schedule puts this isend (model path): the connection's next send of the
 * gradient allreduces in bucket order, skipping the ones that do not use its channel. A
 * size the schedule did not predict stops tagging before anything else is labelled. */
static void place(struct comm *c, struct req *r, size_t size, int tag)
{
	const struct ckm_sched *s = &g_cfg.sched;
	if (!first_checks(c, tag))
		return;
	uint64_t count, sends;
	int b = 0;
	for (int k = 0;; k++) {
		b = (int)(c->coll % (uint64_t)g_cfg.nbuckets);
		count = g_cfg.bucket[b];
		if ((sends = ckm_sched_sends(s, count, c->channel)))
			break;
		if (k == g_cfg.nbuckets) {
			refuse(c->ctx, "an isend on channel %d, which no gradient allreduce uses",
			       c->channel);
			return;
		}
		c->coll++;
		c->ci = 0;
	}
	struct ckm_slice sl;
	ckm_sched_slice(s, count, c->channel, c->ci, &sl);
	if (size != sl.count * 4) {
		refuse(c->ctx, "isend of %zu bytes where the schedule expects %llu (allreduce %llu, "
		       "bucket %d of %llu elements, channel %d, send %llu): NCCL's schedule differs",
		       size, (unsigned long long)(sl.count * 4), (unsigned long long)c->coll, b,
		       (unsigned long long)count, c->channel, (unsigned long long)c->ci);
		return;
	}
	if (sl.final && sl.count && index_proven(c)) {
		r->repl = 1;
		r->flat = g_cfg.base[b] + sl.offset;
		r->iteration = g_cfg.first_iteration + c->coll / (uint64_t)g_cfg.nbuckets;
	}
	if (++c->ci == sends) {
		c->ci = 0;
		c->coll++;
	}
}

/* The profiler path: the step's events name collective, channel and slice (profiler.cc:
 * ProxyStep step = DIVUP(stepId, sliceSteps), one per isend since NCCL 2.24); the schedule
 * gives that slice's elements. Anything unproven stops tagging. */
static void place_profiled(struct comm *c, struct req *r, size_t size, int tag, void *phandle)
{
	const struct ckm_sched *s = &g_cfg.sched;
	struct ckm_ident id;
	struct ckm_query q = {.magic = CKM_QUERY_MAGIC};
	int known = ckm_prof_identity(phandle, &id) == 0;
	if (!known && phandle && c->ctx->prof_fn) {
		void *eh = NULL;
		if (c->ctx->prof_fn(&eh, CKM_PROF_NET_EVENT_START, phandle, CKM_PROF_NET_ID, &q) ==
		    ncclSuccess && eh)
			c->ctx->prof_fn(&eh, CKM_PROF_NET_EVENT_STOP, phandle, CKM_PROF_NET_ID, NULL);
		if ((known = q.found))
			id = q.id;
	}
	if (!known) {
		refuse(c->ctx, "an isend carries no ckm profiler step (NCCL_PROFILER_PLUGIN must "
		       "name this library)");
		return;
	}
	if (id.bad) {
		refuse(c->ctx, "%s", id.why);
		return;
	}
	if (!id.tagged)
		return; /* not a gradient bucket: plain */
	if (!first_checks(c, tag))
		return;
	int next = (s->rank + 1) % s->nranks;
	if (!id.is_send || id.peer != next || id.channel != c->channel) {
		refuse(c->ctx, "profiler step of a %s op to rank %d on channel %d, sent on connection "
		       "%d: the schedule sends to the next rank %d, connection k = channel k",
		       id.is_send ? "send" : "recv", id.peer, id.channel, c->channel, next);
		return;
	}
	uint64_t i = (uint64_t)id.step, sends = ckm_sched_sends(s, id.count, id.channel);
	if (id.step < 0 || i >= sends) {
		refuse(c->ctx, "profiler step %d outside the %llu slices the schedule has on channel "
		       "%d", id.step, (unsigned long long)sends, id.channel);
		return;
	}
	struct ckm_slice sl;
	ckm_sched_slice(s, id.count, id.channel, i, &sl);
	if (size != sl.count * 4) {
		refuse(c->ctx, "isend of %zu bytes at step %d of channel %d where the schedule "
		       "expects %llu", size, id.step, id.channel, (unsigned long long)(sl.count * 4));
		return;
	}
	if (sl.final && sl.count && index_proven(c)) {
		int b = (int)(id.tag_index % (uint64_t)g_cfg.nbuckets);
		r->repl = 1;
		r->flat = g_cfg.base[b] + sl.offset;
		r->iteration = g_cfg.first_iteration + id.tag_index / (uint64_t)g_cfg.nbuckets;
	}
}

static ncclResult_t isend_locked(void *sendComm, void *data, size_t size, int tag,
				 void *mhandle, void *phandle, void **request)
{
	struct comm *c = sendComm;
	(void)mhandle;
	*request = NULL;
	if (c->failed)
		return ncclRemoteError;
	struct req *r = new_req(c, K_SEND);
	if (!r)
		return ncclSuccess; /* full: NCCL calls again */
	ncclResult_t res;
	if (c->ctx && c->ctx->tagging)
		place(c, r, size, tag);
	else if (c->ctx && c->ctx->prof)
		place_profiled(c, r, size, tag, phandle);
	if (c->ctx && !c->ctx->tagging && !c->ctx->prof)
		r->repl = 0; /* refused while placing: this one goes plain too */
	r->buf = data;
	r->size = size;
	r->msg = c->msg++;
	c->q[(c->qh + c->qn++) % MAX_REQS] = r;
	if ((res = cut(c)))
		return res;
	*request = r;
	return ncclSuccess;
}

static ncclResult_t irecv_locked(void *recvComm, int n, void **data, size_t *sizes, int *tags,
				 void **mhandles, void **phandles, void **request)
{
	struct comm *c = recvComm;
	(void)mhandles;
	(void)phandles;
	*request = NULL;
	if (c->failed)
		return ncclRemoteError;
	if (n != 1)
		return fail(c, ncclInvalidUsage, "irecv of %d buffers: maxRecvs is 1", n);
	/* NCCL tags a receive with the sender's top-parent rank (net.cc:1488). */
	int prev = g_cfg.tagging ? (g_cfg.sched.rank + g_cfg.sched.nranks - 1) % g_cfg.sched.nranks
				 : -1;
	if (c->ctx && (c->ctx->tagging || c->ctx->prof) && tags && tags[0] != prev)
		refuse(c->ctx, "its ring receives from rank %d where the schedule needs the previous "
		       "rank %d (ring order = rank order)", tags[0], prev);
	struct req *r = new_req(c, K_RECV);
	if (!r)
		return ncclSuccess;
	r->buf = data[0];
	r->size = sizes[0];
	r->msg = c->msg++;
	c->q[(c->qh + c->qn++) % MAX_REQS] = r;
	*request = r;
	return progress_recv(c);
}

static ncclResult_t ckm_iflush(void *recvComm, int n, void **data, int *sizes, void **mhandles,
			       void **request)
{
	(void)recvComm;
	(void)n;
	(void)data;
	(void)sizes;
	(void)mhandles;
	*request = NULL; /* host memory: nothing to flush */
	return ncclSuccess;
}

static ncclResult_t test_locked(void *request, int *done, int *sizes)
{
	struct req *r = request;
	struct comm *c = r->c;
	*done = 0;
	if (c->failed)
		return ncclRemoteError;
	ncclResult_t res = r->kind == K_SEND ? progress_send(c) : progress_recv(c);
	if (res)
		return res;
	if (r->done) {
		*done = 1;
		if (sizes)
			*sizes = (int)(r->kind == K_SEND ? r->size : r->pos);
		r->used = 0;
	}
	return ncclSuccess;
}

static ncclResult_t ckm_isend(void *sendComm, void *data, size_t size, int tag, void *mhandle,
			      void *phandle, void **request)
{
	struct comm *c = sendComm;
	pthread_mutex_lock(&c->mu);
	ncclResult_t r = isend_locked(sendComm, data, size, tag, mhandle, phandle, request);
	pthread_mutex_unlock(&c->mu);
	return r;
}

static ncclResult_t ckm_irecv(void *recvComm, int n, void **data, size_t *sizes, int *tags,
			      void **mhandles, void **phandles, void **request)
{
	struct comm *c = recvComm;
	pthread_mutex_lock(&c->mu);
	ncclResult_t r = irecv_locked(recvComm, n, data, sizes, tags, mhandles, phandles, request);
	pthread_mutex_unlock(&c->mu);
	return r;
}

static ncclResult_t ckm_test(void *request, int *done, int *sizes)
{
	struct comm *c = ((struct req *)request)->c;
	pthread_mutex_lock(&c->mu);
	ncclResult_t r = test_locked(request, done, sizes);
	pthread_mutex_unlock(&c->mu);
	return r;
}

/* CKM_NCCL_STATS=FILE: one JSON line of counters per closed comm (the harness reads it). */
static void dump_stats(struct comm *c)
{
	const char *path = getenv("CKM_NCCL_STATS");
	if (!path || !*path)
		return;
	char line[512];
	int n = snprintf(line, sizeof line,
			 "{\"kind\": \"%s\", \"channel\": %d, \"sent\": %llu, \"resent\": %llu, "
			 "\"acks\": %llu, \"replicated\": %llu, \"repl_elems\": %llu, "
			 "\"received\": %llu, \"duplicate\": %llu, \"foreign\": %llu, "
			 "\"malformed\": %llu, \"corrupt\": %llu, \"overflow\": %llu}\n",
			 c->kind == K_SEND ? "send" : "recv", c->kind == K_SEND ? c->channel : -1,
			 (unsigned long long)c->st.sent, (unsigned long long)c->st.resent,
			 (unsigned long long)c->st.acks, (unsigned long long)c->st.replicated,
			 (unsigned long long)c->st.repl_elems, (unsigned long long)c->st.received,
			 (unsigned long long)c->st.duplicate, (unsigned long long)c->st.foreign,
			 (unsigned long long)c->st.malformed, (unsigned long long)c->st.corrupt,
			 (unsigned long long)c->st.overflow);
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
	if (fd >= 0) {
		if (write(fd, line, (size_t)n) != n)
			say("could not write the stats to %s", path);
		close(fd);
	}
}

static ncclResult_t ckm_close_send(void *sendComm)
{
	struct comm *c = sendComm;
	untrack(c);
	/* Give the peer a moment to acknowledge the tail (NCCL closes after its tests). */
	double until = now_s() + 0.2;
	while (!c->failed && c->tx_base < c->tx_next && now_s() < until) {
		progress_send(c);
		usleep(1000);
	}
	dump_stats(c);
	free_comm(c);
	return ncclSuccess;
}

static ncclResult_t ckm_close_recv(void *recvComm)
{
	struct comm *c = recvComm;
	untrack(c);
	dump_stats(c);
	free_comm(c);
	return ncclSuccess;
}

static ncclResult_t ckm_close_listen(void *listenComm)
{
	struct comm *l = listenComm;
	if (!l->fd_taken)
		close(l->fd);
	if (l->peer_fd >= 0)
		close(l->peer_fd);
	close(l->tcp);
	free(l);
	return ncclSuccess;
}

/* ------------------------------------------------------------------ exported versions */
static ncclResult_t ckm_listen_v10(int dev, void *handle, void **listenComm)
{
	return ckm_listen(&g_v10_ctx, dev, handle, listenComm);
}

static ncclResult_t ckm_connect_v10(int dev, ncclNetCommConfig_t *config, void *handle,
				    void **sendComm, ncclNetDeviceHandle_t **sendDevComm)
{
	(void)config;
	return ckm_connect(&g_v10_ctx, dev, handle, sendComm, sendDevComm);
}

/* v10 has no per-communicator context, so a process's communicators cannot be told apart:
 * plain transport only. */
static ncclResult_t ckm_init_v10(ncclDebugLogger_t logFunction, ncclProfilerCallback_t prof)
{
	(void)prof;
	if (logFunction)
		g_log = logFunction;
	ncclResult_t r = load_config();
	if (r)
		return r;
	if (g_cfg.tagging) {
		say("refusing to start: CKM_NCCL_BUCKETS needs NCCL's v11+ plugin interface (per-"
		    "communicator init); this NCCL loaded ncclNetPlugin_v10");
		return ncclInvalidUsage;
	}
	return ncclSuccess;
}

#define COMMON_SLOTS                                                                         \
	.regMr = ckm_reg_mr, .regMrDmaBuf = ckm_reg_mr_dmabuf, .deregMr = ckm_dereg_mr,         \
	.isend = ckm_isend, .irecv = ckm_irecv, .iflush = ckm_iflush, .test = ckm_test,         \
	.closeSend = ckm_close_send, .closeRecv = ckm_close_recv,                               \
	.closeListen = ckm_close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,            \
	.makeVDevice = NULL

EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {
	.name = "ckm", .init = ckm_init, .devices = ckm_devices,
	.getProperties = ckm_get_properties_v12, .listen = ckm_listen, .connect = ckm_connect,
	.accept = ckm_accept, COMMON_SLOTS, .finalize = ckm_finalize,
	.setNetAttr = ckm_set_net_attr,
};

EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
	.name = "ckm", .init = ckm_init, .devices = ckm_devices,
	.getProperties = ckm_get_properties_v11, .listen = ckm_listen, .connect = ckm_connect,
	.accept = ckm_accept, COMMON_SLOTS, .finalize = ckm_finalize,
	.setNetAttr = ckm_set_net_attr,
};

EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
	.name = "ckm", .init = ckm_init_v10, .devices = ckm_devices,
	.getProperties = ckm_get_properties_v10, .listen = ckm_listen_v10,
	.connect = ckm_connect_v10, .accept = ckm_accept, COMMON_SLOTS,
};
