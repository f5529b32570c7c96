/* The net plugin's transport: NCCL's point-to-point messages as ckm datagrams over UDP,
 * reliable and ordered per connection (window, cumulative ACKs with NACK lists, resends on
 * a timer, receiver credit). A separate unit because it is the one part that knows sockets
 * and sequence numbers; which sends are fully reduced, and so go out as REPLICATE pieces
 * with their data tag, is decided in ckm_tagging.c before a request is cut here.
 *
 * Everything runs on the caller's thread: NCCL's proxy thread calls isend/irecv/test in a
 * loop, and each call moves its connection forward. The progress thread (below) only keeps
 * connections NCCL no longer tests moving. Bounded memory per comm. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
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
#include "ckm_net.h"
#include "ckm_repair.h"
#include "ckm_wire.h"

#define SOCK_BUF (4 << 20)

ncclResult_t fail(struct comm *c, ncclResult_t r, const char *fmt, ...)
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

double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t rand64(void)
{
	uint64_t x = 0;
	if (getrandom(&x, sizeof x, 0) != sizeof x)
		x = (uint64_t)now_s() * 2654435761u ^ (uint64_t)getpid();
	return x;
}

/* ------------------------------------------------------------------ sockets */
int open_udp(int bind_range, struct sockaddr_in *self)
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
ncclResult_t cut(struct comm *c)
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
		int ix = known_ring_index(c);
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

ncclResult_t progress_send(struct comm *c)
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

ncclResult_t progress_recv(struct comm *c)
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

void track(struct comm *c)
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

void untrack(struct comm *c)
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

/* ------------------------------------------------------------------ closing */
void free_comm(struct comm *c)
{
	if (c->fd >= 0)
		close(c->fd);
	if (c->peer_fd >= 0)
		close(c->peer_fd);
	free(c->rx);
	free(c);
}

/* CKM_NCCL_STATS=FILE: one JSON line of counters per closed comm (the harness reads it). */
void dump_stats(struct comm *c)
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
