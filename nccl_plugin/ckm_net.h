/* What the net plugin's parts share (ckm_net.c the NCCL interface, ckm_setup.c the
 * connection setup, ckm_transport.c the reliable datagram transport, ckm_tagging.c where an
 * isend sits in the schedule): the connection state and the functions they call across
 * files. Internal: nothing here is exported (the library exports only NCCL's symbols). */
#ifndef CKM_NET_H
#define CKM_NET_H

#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ckm_config.h"
#include "ckm_nccl_abi.h"
#include "ckm_wire.h"

#define WINDOW 256                 /* datagrams in flight per connection */
#define MAX_REQS 64                /* requests in flight per comm (NCCL needs 32) */
#define PAY_MAX CKM_MAX_PAYLOAD_JUMBO /* one 9000-byte frame: 9000 - IPv4 - UDP - ckm header */
#define REPL_ELEMS (PAY_MAX / 4)   /* float32 per REPLICATE piece: the switch copies frames */
#define DG_MAX (CKM_HEADER_LEN + PAY_MAX)
#define NACK_MAX 64
#define RTO 0.02                   /* seconds without acknowledgement before resending */
#define NACK_GAP 0.002
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

/* ckm_transport.c: the datagram transport */
/* Marks the comm failed and says why once; returns r. */
ncclResult_t fail(struct comm *c, ncclResult_t r, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
double now_s(void);
uint64_t rand64(void);
/* A UDP socket on CKM_NCCL_IP: in the ckm port range (receivers) or any port (senders). */
int open_udp(int bind_range, struct sockaddr_in *self);
/* Cuts queued send requests into datagrams while the window and the credit allow. */
ncclResult_t cut(struct comm *c);
/* One round of a connection: take what arrived, send what the window allows, resend. */
ncclResult_t progress_send(struct comm *c);
ncclResult_t progress_recv(struct comm *c);
/* A connected comm joins (track) or leaves (untrack) the progress thread's list. */
void track(struct comm *c);
void untrack(struct comm *c);
void free_comm(struct comm *c);
/* CKM_NCCL_STATS=FILE: one JSON line of counters per closed comm. */
void dump_stats(struct comm *c);

/* ckm_tagging.c: what a send carries, and the checks before any label */
/* Tagging stops for the communicator, with one line (NCCL carries on plain). */
void refuse(struct ckm_ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The running NCCL's release, refused when its schedule was not checked. */
void check_release(struct ckm_ctx *x);
/* The partition owning flat element x; *hi is where that partition ends. */
int owner(uint64_t x, uint64_t *hi);
/* This rank's ring index on the comm's channel as the ring proved it, or -1. */
int known_ring_index(const struct comm *c);
/* A received datagram's ring index from the previous rank (see ckm_ctx.ring_index). */
void learn_index(struct comm *c, const struct ckm_hdr *h);
/* Where the schedule puts an isend: model path (place) or profiler path (place_profiled);
 * sets r->repl, r->flat and r->iteration when it carries fully reduced elements. */
void place(struct comm *c, struct req *r, size_t size, int tag);
void place_profiled(struct comm *c, struct req *r, size_t size, int tag, void *phandle);

/* ckm_setup.c: listen, connect, accept (NCCL's setup calls) */
ncclResult_t ckm_listen(void *ctx, int dev, void *handle, void **listenComm);
ncclResult_t ckm_connect(void *ctx, int dev, void *handle, void **sendComm,
			 ncclNetDeviceHandle_t **sendDevComm);
ncclResult_t ckm_accept(void *listenComm, void **recvComm, ncclNetDeviceHandle_t **recvDevComm);
ncclResult_t ckm_close_listen(void *listenComm);

#endif
