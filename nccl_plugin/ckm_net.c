/* The ckm NCCL network plugin: NCCL's point-to-point traffic as ckm datagrams over UDP,
 * reliable and ordered per connection, with each fully reduced ring chunk sent once with
 * REPLICATE so the switch copies it to its shadow (docs/nccl_plugin.md).
 *
 * This unit is NCCL's interface: init per communicator, properties, isend/irecv/test, close,
 * and the exported vtables (v12, v11, v10). It owns no transport or tagging logic: setup is
 * ckm_setup.c, the datagrams ckm_transport.c, what a send carries ckm_tagging.c. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckm_config.h"
#include "ckm_nccl_abi.h"
#include "ckm_net.h"
#include "ckm_repair.h"

#define EXPORT __attribute__((visibility("default")))

static int g_inits;
static struct ckm_ctx g_v10_ctx;

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
	ckm_set_logger(logFunction);
	int index, selected;
	ncclResult_t r = ckm_comm_begin(&g_inits, &index, &selected);
	if (r)
		return r;
	struct ckm_ctx *x = calloc(1, sizeof *x);
	if (!x)
		return ncclSystemError;
	x->comm_id = commId;
	x->prof_fn = profFunction;
	x->index = index;
	x->tagging = selected && g_cfg.identity == CKM_IDENTITY_MODEL;
	x->prof = selected && g_cfg.identity == CKM_IDENTITY_PROFILER;
	for (int i = 0; i < 64; i++)
		x->ring_index[i] = g_cfg.tagging && g_cfg.sched.rank == 0 ? 0 : -1;
	*ctx = x;
	if (!selected)
		return ncclSuccess;
	check_release(x);
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
	ckm_set_logger(logFunction);
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
