/* The net plugin's connection setup (NCCL's listen, connect and accept): a listener hands
 * NCCL a handle {address, UDP port, TCP port, listen id, rank}; the sender introduces itself
 * over TCP (which retransmits, so setup survives a lossy path) and the accepted connection
 * takes over the listener's UDP socket. A separate unit because it is the only part that
 * talks TCP and the only one that knows the handle; ckm_transport.c carries the data. The
 * model path's setup checks (connection k is channel k, the next rank listens) are here
 * because only setup sees them. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ckm_config.h"
#include "ckm_nccl_abi.h"
#include "ckm_net.h"

#define HANDLE_MAGIC 0x434b4d4eu   /* "CKMN" */

struct handle {
	uint32_t magic, ip;
	uint16_t udp_port, tcp_port;
	uint64_t listen_id;
	struct comm *pending; /* connect's state between NCCL's calls; NULL from the peer */
	int32_t rank;         /* the listener's ring rank (CKM_NCCL_RANK), -1 when not tagging */
};
_Static_assert(sizeof(struct handle) <= NCCL_NET_HANDLE_MAXSIZE, "handle size");

ncclResult_t ckm_listen(void *ctx, int dev, void *handle, void **listenComm)
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

/* Setup exchange, sender side: TCP to the listener, 24 bytes {magic, listen id, token, UDP
 * port, address}, then one byte back once the receiver is ready. Never blocks: returns
 * *sendComm = NULL until done, keeping its state in the handle as NCCL's own plugins do. */
ncclResult_t ckm_connect(void *ctx, int dev, void *handle, void **sendComm,
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
ncclResult_t ckm_accept(void *listenComm, void **recvComm,
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

ncclResult_t ckm_close_listen(void *listenComm)
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
