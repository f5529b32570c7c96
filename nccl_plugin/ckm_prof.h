/* The profiler-identity path (CKM_NCCL_IDENTITY=profiler): this library is also NCCL's
 * profiler plugin (ncclProfiler_v6), so each isend's phandle is our own proxy-step event,
 * which names the collective, channel and step it belongs to (docs/nccl_plugin.md). */
#ifndef CKM_PROF_H
#define CKM_PROF_H

#include <stdint.h>

struct ckm_ident {
	int tagged;          /* a gradient bucket this rank's sends replicate */
	int bad;             /* a gradient bucket the plugin cannot tag: why says why */
	uint64_t tag_index;  /* gradient allreduces before it on the communicator */
	uint64_t count;      /* elements */
	int channel, peer, step, nsteps, is_send;
	const char *why;
};

/* 0 and *out filled when phandle is one of our proxy-step events, else -1. */
int ckm_prof_identity(void *phandle, struct ckm_ident *out);

/* The other route, when NCCL's phandle is its own object: the net plugin calls NCCL's
 * profiler callback with a NetPlugin event whose data is this query; NCCL hands it to our
 * profiler's startEvent with our proxy-step event as parent, which fills it in. */
#define CKM_PROF_NET_ID 0x636b6d  /* pluginId of our NetPlugin events */
#define CKM_QUERY_MAGIC 0x636b6d7175657279ull
struct ckm_query {
	uint64_t magic;
	int found;
	struct ckm_ident id;
	char why[200];
};

#endif
