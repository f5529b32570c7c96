/* ncclProfiler_v6 as an identity source for the net plugin; see ckm_prof.h. Only the
 * Coll, ProxyOp and ProxyStep events are asked for; each event copies what it needs from
 * its parent when it starts, so a parent stopped early leaves nothing dangling. */
#include "ckm_prof.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ckm_config.h"
#include "ckm_sched.h"

#define EXPORT __attribute__((visibility("default")))
#define CTX_MAGIC 0x636b6d7063747800ull /* "ckmpctx" */
#define EV_MAGIC 0x636b6d7065760000ull  /* "ckmpev" */

struct pctx {
	uint64_t magic, comm_id;
	int index, selected;
	uint64_t buckets_seen; /* gradient allreduces started so far */
};

struct pev {
	uint64_t magic;
	uint64_t type;
	struct pev *next, *prev; /* live proxy steps: a phandle is looked up, never trusted */
	struct ckm_ident id;
	char why[200];
};

static int g_pinits;

/* Collective packing (several collectives in one kernel plan) changes how each is spread
 * over the channels. NCCL plans a group at its end, so a Coll event's group is complete when
 * it starts: GroupApi and CollApi events (profiler.cc:246-330; Coll's parent is its CollApi,
 * whose parent is the outermost GroupApi) say how many collectives share it. Their handles
 * are slots of fixed rings, never freed (NCCL stops API events before the Coll starts), so a
 * Coll's parent is looked up by address and generation, never dereferenced blindly. */
#define NGROUPS 1024
#define NCAPIS 4096
struct gslot {
	uint64_t gen;
	int colls;
};
struct cslot {
	struct gslot *group;
	uint64_t gen;
};
static struct gslot g_groups[NGROUPS];
static struct cslot g_capis[NCAPIS];
static uint64_t g_ngroups, g_ncapis, g_gen;
static pthread_mutex_t g_api_lock = PTHREAD_MUTEX_INITIALIZER;

static void *group_start(void)
{
	pthread_mutex_lock(&g_api_lock);
	struct gslot *g = &g_groups[g_ngroups++ % NGROUPS];
	g->gen = ++g_gen;
	g->colls = 0;
	pthread_mutex_unlock(&g_api_lock);
	return g;
}

static void *coll_api_start(const void *parent)
{
	pthread_mutex_lock(&g_api_lock);
	struct cslot *c = &g_capis[g_ncapis++ % NCAPIS];
	c->group = NULL;
	const struct gslot *g = parent;
	if (g >= g_groups && g < g_groups + NGROUPS &&
	    ((const char *)g - (const char *)g_groups) % sizeof *g == 0) {
		c->group = (struct gslot *)g;
		c->gen = g->gen;
		c->group->colls++;
	}
	pthread_mutex_unlock(&g_api_lock);
	return c;
}

/* Collectives in the Coll's group, or 0 when its parent is not a CollApi event of ours. */
static int group_colls(const void *parent)
{
	int n = 0;
	pthread_mutex_lock(&g_api_lock);
	const struct cslot *c = parent;
	if (c >= g_capis && c < g_capis + NCAPIS &&
	    ((const char *)c - (const char *)g_capis) % sizeof *c == 0 && c->group &&
	    c->group->gen == c->gen)
		n = c->group->colls;
	pthread_mutex_unlock(&g_api_lock);
	return n;
}
static pthread_mutex_t g_steps_lock = PTHREAD_MUTEX_INITIALIZER;
static struct pev *g_steps;

static void steps_add(struct pev *e)
{
	pthread_mutex_lock(&g_steps_lock);
	e->prev = NULL;
	e->next = g_steps;
	if (g_steps)
		g_steps->prev = e;
	g_steps = e;
	pthread_mutex_unlock(&g_steps_lock);
}

static void steps_remove(struct pev *e)
{
	pthread_mutex_lock(&g_steps_lock);
	if (e->prev)
		e->prev->next = e->next;
	else
		g_steps = e->next;
	if (e->next)
		e->next->prev = e->prev;
	pthread_mutex_unlock(&g_steps_lock);
}

static int same(const char *a, const char *b) { return a && strcasecmp(a, b) == 0; }

static int is_float32(const char *dt)
{
	return dt && (strcasecmp(dt, "ncclFloat32") == 0 || strcasecmp(dt, "ncclFloat") == 0 ||
		      strcasecmp(dt, "float32") == 0);
}

static ncclResult_t p_init(void **context, uint64_t commId, int *eActivationMask,
			   const char *commName, int nNodes, int nranks, int rank,
			   ncclDebugLogger_t logfn)
{
	(void)commName;
	(void)nNodes;
	(void)logfn;
	*context = NULL;
	int index, selected;
	ncclResult_t r = ckm_comm_begin(&g_pinits, &index, &selected);
	if (r)
		return r;
	struct pctx *c = calloc(1, sizeof *c);
	if (!c)
		return ncclSystemError;
	c->magic = CTX_MAGIC;
	c->comm_id = commId;
	c->index = index;
	c->selected = selected && g_cfg.identity == CKM_IDENTITY_PROFILER;
	if (c->selected && (nranks != g_cfg.sched.nranks || rank != g_cfg.sched.rank)) {
		say("profiler: the tagged communicator is rank %d of %d, the settings say %d of %d",
		    rank, nranks, g_cfg.sched.rank, g_cfg.sched.nranks);
		free(c);
		return ncclInvalidUsage;
	}
	*eActivationMask = c->selected ? CKM_PROFILE_GROUP_API | CKM_PROFILE_COLL_API |
		CKM_PROFILE_COLL | CKM_PROFILE_PROXY_OP | CKM_PROFILE_PROXY_STEP |
		CKM_PROFILE_NET_PLUGIN : 0;
	*context = c;
	return ncclSuccess;
}

static void mark_bad(struct pev *e, const char *why)
{
	e->id.bad = 1;
	snprintf(e->why, sizeof e->why, "%s", why);
	e->id.why = e->why;
}

/* A collective: a gradient bucket when it is the allreduce the bucket list expects next. */
static void start_coll(struct pctx *c, struct pev *e, const ncclProfilerEventDescr_v6_t *d)
{
	uint64_t next = c->buckets_seen % (uint64_t)g_cfg.nbuckets;
	if (!same(d->coll.func, "AllReduce") || !is_float32(d->coll.datatype) ||
	    d->coll.count != g_cfg.bucket[next])
		return; /* not a gradient bucket: its sends stay plain */
	e->id.tag_index = c->buckets_seen++;
	e->id.count = d->coll.count;
	char why[200];
	int in_group = group_colls(d->parentObj);
	if (in_group != 1) {
		snprintf(why, sizeof why, "gradient allreduce %llu %s: its spread over the channels is "
			 "not the schedule's", (unsigned long long)d->coll.seqNumber, in_group ?
			 "was grouped with other collectives into one kernel plan (packing)" :
			 "came without its group's API events, so packing cannot be ruled out");
		mark_bad(e, why);
		return;
	}
	/* Coll's nChannels is task->nChannels, the channels the plan gave it (enqueue.cc:690) */
	int want = ckm_sched_nchannels(&g_cfg.sched, d->coll.count);
	if (!same(d->coll.algo, "Ring") || !same(d->coll.proto, "Simple") ||
	    d->coll.nChannels != want) {
		snprintf(why, sizeof why, "gradient allreduce %llu ran as %s/%s on %d channels where "
			 "the schedule has Ring/Simple on %d (tuner, channel pins, packing)",
			 (unsigned long long)d->coll.seqNumber, d->coll.algo ? d->coll.algo : "?",
			 d->coll.proto ? d->coll.proto : "?", d->coll.nChannels, want);
		mark_bad(e, why);
		return;
	}
	e->id.tagged = 1;
}

static void start_op(struct pev *e, const struct pev *coll, const ncclProfilerEventDescr_v6_t *d)
{
	e->id = coll->id;
	memcpy(e->why, coll->why, sizeof e->why);
	e->id.why = e->why;
	e->id.channel = d->proxyOp.channelId;
	e->id.peer = d->proxyOp.peer;
	e->id.nsteps = d->proxyOp.nSteps;
	e->id.is_send = d->proxyOp.isSend;
	if (!e->id.tagged || e->id.bad || !e->id.is_send)
		return;
	/* nSteps = DIVUP(nsteps, sliceSteps): one per isend; chunkSize = chunkSize * sliceSteps
	 * (profiler.cc:579-580, since NCCL 2.24) */
	uint64_t want = ckm_sched_sends(&g_cfg.sched, e->id.count, e->id.channel);
	uint64_t chunk = ckm_sched_prof_chunk(&g_cfg.sched);
	if (!want || (uint64_t)e->id.nsteps != want || (uint64_t)d->proxyOp.chunkSize != chunk) {
		char why[200];
		snprintf(why, sizeof why, "proxy op of %d steps of %zu bytes on channel %d where the "
			 "schedule has %llu of %llu: NCCL's schedule differs", e->id.nsteps,
			 (size_t)d->proxyOp.chunkSize, e->id.channel, (unsigned long long)want,
			 (unsigned long long)chunk);
		mark_bad(e, why);
	}
}

static ncclResult_t p_start(void *context, void **eHandle, ncclProfilerEventDescr_v6_t *d)
{
	struct pctx *c = context;
	*eHandle = NULL;
	if (!c || c->magic != CTX_MAGIC || !c->selected)
		return ncclSuccess;
	if (d->type == CKM_PROFILE_GROUP_API) {
		*eHandle = group_start();
		return ncclSuccess;
	}
	if (d->type == CKM_PROFILE_COLL_API) {
		*eHandle = coll_api_start(d->parentObj);
		return ncclSuccess;
	}
	const struct pev *parent = d->parentObj;
	if (d->type != CKM_PROFILE_COLL && (!parent || parent->magic != EV_MAGIC))
		return ncclSuccess; /* a child of an event we did not make */
	if (d->type == CKM_PROFILE_NET_PLUGIN) { /* the query route: see ckm_prof.h */
		struct ckm_query *q = d->netPlugin.data;
		if (d->netPlugin.id == CKM_PROF_NET_ID && q && q->magic == CKM_QUERY_MAGIC &&
		    parent->type == CKM_PROFILE_PROXY_STEP) {
			q->id = parent->id;
			memcpy(q->why, parent->why, sizeof q->why);
			q->id.why = q->why;
			q->found = 1;
		}
		return ncclSuccess;
	}
	struct pev *e = calloc(1, sizeof *e);
	if (!e)
		return ncclSystemError;
	e->magic = EV_MAGIC;
	e->type = d->type;
	switch (d->type) {
	case CKM_PROFILE_COLL:
		start_coll(c, e, d);
		break;
	case CKM_PROFILE_PROXY_OP:
		start_op(e, parent, d);
		break;
	case CKM_PROFILE_PROXY_STEP:
		*e = *parent;
		e->type = d->type;
		e->id.why = e->why;
		e->id.step = d->proxyStep.step;
		steps_add(e);
		break;
	default:
		free(e);
		return ncclSuccess;
	}
	*eHandle = e;
	return ncclSuccess;
}

static ncclResult_t p_stop(void *eHandle)
{
	struct pev *e = eHandle;
	if ((void *)e >= (void *)g_groups && (void *)e < (void *)(g_groups + NGROUPS))
		return ncclSuccess; /* API events: slots, never freed */
	if ((void *)e >= (void *)g_capis && (void *)e < (void *)(g_capis + NCAPIS))
		return ncclSuccess;
	if (e && e->magic == EV_MAGIC) {
		if (e->type == CKM_PROFILE_PROXY_STEP)
			steps_remove(e);
		e->magic = 0;
		free(e);
	}
	return ncclSuccess;
}

static ncclResult_t p_record(void *eHandle, int eState, void *eStateArgs)
{
	(void)eHandle;
	(void)eState;
	(void)eStateArgs;
	return ncclSuccess;
}

static ncclResult_t p_finalize(void *context)
{
	struct pctx *c = context;
	if (c && c->magic == CTX_MAGIC) {
		c->magic = 0;
		free(c);
	}
	return ncclSuccess;
}

int ckm_prof_identity(void *phandle, struct ckm_ident *out)
{
	int found = 0;
	pthread_mutex_lock(&g_steps_lock);
	for (const struct pev *e = g_steps; e && !found; e = e->next)
		if ((void *)e == phandle) { /* one of our live steps; NCCL's own objects are not */
			*out = e->id;
			out->why = e->why;
			found = 1;
		}
	pthread_mutex_unlock(&g_steps_lock);
	return found ? 0 : -1;
}

EXPORT const ncclProfiler_v6_t ncclProfiler_v6 = {
	.name = "ckm", .init = p_init, .startEvent = p_start, .stopEvent = p_stop,
	.recordEventState = p_record, .finalize = p_finalize,
};
