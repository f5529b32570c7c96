/* The net plugin's tagging: where each isend of the tagged communicator sits in NCCL's
 * ring schedule (ckm_sched.c), from the schedule model alone (place) or from its profiler
 * step (place_profiled, ckm_prof.c), and everything that must be proven before a label is
 * sent (docs/nccl_plugin.md, "What the plugin proves"). A separate unit because it is the
 * one part that decides what a send means; the transport (ckm_transport.c) only carries it.
 * Whatever is not proven stops tagging for the communicator with one line (refuse): an
 * untagged chunk costs a re-seed, a wrong label the checkpoint. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>

#include "ckm_config.h"
#include "ckm_net.h"
#include "ckm_prof.h"
#include "ckm_sched.h"
#include "ckm_tuner.h"

/* Tagging stops for the communicator, with one line; the transport carries on plain, so
 * NCCL keeps working and the shadows re-seed. A label the plugin cannot prove is never sent. */
void refuse(struct ckm_ctx *x, const char *fmt, ...)
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

void check_release(struct ckm_ctx *x)
{
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
}

/* The partition owning flat element x: [i*total//n, (i+1)*total//n) (checkmate/spec/partition.py). */
int owner(uint64_t x, uint64_t *hi)
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

/* See ckm_ctx.ring_index; -1 also for a comm without context or channel. */
int known_ring_index(const struct comm *c)
{
	return c->ctx && c->channel >= 0 && c->channel < 64
		? __atomic_load_n(&c->ctx->ring_index[c->channel], __ATOMIC_RELAXED) : -1;
}

/* A plain datagram from the previous rank names its ring index (see ckm_ctx.ring_index). */
void learn_index(struct comm *c, const struct ckm_hdr *h)
{
	struct ckm_ctx *x = c->ctx;
	uint32_t v = ntohl(h->fec_group);
	/* learned and passed on even where this rank refused: the next ranks need it */
	if (!x || !ckm_comm_selected(x->index) || (h->flags & CKM_F_REPLICATE) ||
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
	/* Exactly CKM_NCCL_CHANNELS send connections: the communicator's channel count equals
	 * the tuner's, which the schedule (ckm_sched.c, plan) takes as one number. */
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
	if (known_ring_index(c) == g_cfg.sched.rank)
		return 1;
	refuse(c->ctx, "its ring position on channel %d is not proven yet (no ring index from the "
	       "previous rank before the first fully reduced send)", c->channel);
	return 0;
}

/* Where the schedule puts this isend (model path): the connection's next send of the
 * gradient allreduces in bucket order, skipping the ones that do not use its channel. A
 * size the schedule did not predict stops tagging before anything else is labelled. */
void place(struct comm *c, struct req *r, size_t size, int tag)
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
void place_profiled(struct comm *c, struct req *r, size_t size, int tag, void *phandle)
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
