/* ncclTunerPlugin_v5: pins what the schedule model needs for every allreduce of a process
 * that tags (CKM_NCCL_BUCKETS set): algorithm Ring, protocol Simple (every other cost-table
 * entry set to NCCL_ALGO_PROTO_IGNORE) and CKM_NCCL_CHANNELS channels (the tuner's nChannels
 * output overrides NCCL's per-size channel tuning). NCCL 2.28-2.30 load v5 (2.30 tries v6
 * first and falls back); NCCL_TUNER_PLUGIN names this library. docs/nccl_plugin.md cites
 * the source. The net plugin tags a communicator only after this tuner pinned it. */
#include "ckm_tuner.h"

#include <pthread.h>
#include <stdlib.h>

#include "ckm_config.h"

#define EXPORT __attribute__((visibility("default")))
#define FUNC_ALLREDUCE 4       /* ncclFuncAllReduce (nccl_common.h) */
#define ALGO_RING 1            /* NCCL_ALGO_RING (nccl_tuner.h) */
#define PROTO_SIMPLE 2         /* NCCL_PROTO_SIMPLE */
#define ALGO_PROTO_IGNORE -1.0f /* NCCL_ALGO_PROTO_IGNORE */
#define MAX_COMMS 256

struct tctx {
	uint64_t comm_id;
	size_t nranks;
	int unpinned; /* an allreduce NCCL could not run as Ring/Simple */
	int off_list; /* model path: an allreduce that is not the next bucket (below) */
	uint64_t calls; /* allreduces asked about */
};

static pthread_mutex_t g_tlock = PTHREAD_MUTEX_INITIALIZER;
static struct tctx *g_tctx[MAX_COMMS];

typedef struct {
	int nNvlDomains, minRanksPerNvlDomain, maxRanksPerNvlDomain;
} ckm_nvl_domain_info_v5;

static ncclResult_t t_init(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes,
			   ncclDebugLogger_t logFunction, ckm_nvl_domain_info_v5 *nvl, void *constants)
{
	(void)nNodes;
	(void)logFunction;
	(void)nvl;
	(void)constants; /* the cost constants stay NCCL's */
	*ctx = NULL;
	ncclResult_t r = load_config();
	if (r)
		return r;
	struct tctx *t = calloc(1, sizeof *t);
	if (!t)
		return ncclSystemError;
	t->comm_id = commId;
	t->nranks = nRanks;
	pthread_mutex_lock(&g_tlock);
	for (int i = 0; i < MAX_COMMS; i++)
		if (!g_tctx[i]) {
			g_tctx[i] = t;
			break;
		}
	pthread_mutex_unlock(&g_tlock);
	*ctx = t;
	return ncclSuccess;
}

static ncclResult_t t_get_coll_info(void *context, int collType, size_t nBytes, int numPipeOps,
				    float **collCostTable, int numAlgo, int numProto, int regBuff,
				    int *nChannels)
{
	struct tctx *t = context;
	(void)nBytes;
	(void)numPipeOps;
	(void)regBuff;
	if (!t || !g_cfg.tagging || collType != FUNC_ALLREDUCE)
		return ncclSuccess; /* NCCL's own choice */
	/* The table is float[numAlgo][numProto], passed as float** (enqueue.cc:2045,2054). */
	/* The model path counts every allreduce of the communicator as the next bucket. NCCL
	 * asks once per allreduce, or once for several grouped ones of sizes within 4x, with
	 * their summed size (enqueue.cc:425-436): a size or order other than the bucket list's
	 * means another allreduce or a group, which the model path cannot place. */
	if (g_cfg.identity == CKM_IDENTITY_MODEL &&
	    nBytes != 4 * g_cfg.bucket[t->calls % (uint64_t)g_cfg.nbuckets])
		t->off_list = 1;
	t->calls++;
	float *table = (float *)collCostTable;
	if (numAlgo <= ALGO_RING || numProto <= PROTO_SIMPLE ||
	    table[ALGO_RING * numProto + PROTO_SIMPLE] == ALGO_PROTO_IGNORE) {
		t->unpinned = 1; /* Ring/Simple is not available here: leave NCCL alone */
		return ncclSuccess;
	}
	for (int a = 0; a < numAlgo; a++)
		for (int p = 0; p < numProto; p++)
			if (a != ALGO_RING || p != PROTO_SIMPLE)
				table[a * numProto + p] = ALGO_PROTO_IGNORE;
	*nChannels = g_cfg.sched.channels;
	return ncclSuccess;
}

static ncclResult_t t_finalize(void *context)
{
	struct tctx *t = context;
	pthread_mutex_lock(&g_tlock);
	for (int i = 0; i < MAX_COMMS; i++)
		if (g_tctx[i] == t)
			g_tctx[i] = NULL;
	pthread_mutex_unlock(&g_tlock);
	free(t);
	return ncclSuccess;
}

int ckm_tuner_pinned(uint64_t comm_id, const char **why)
{
	int found = 0, unpinned = 0, off = 0;
	pthread_mutex_lock(&g_tlock);
	for (int i = 0; i < MAX_COMMS; i++)
		if (g_tctx[i] && g_tctx[i]->comm_id == comm_id) {
			found = 1;
			unpinned = g_tctx[i]->unpinned;
			off = g_tctx[i]->off_list;
		}
	pthread_mutex_unlock(&g_tlock);
	if (!found)
		*why = "the ckm tuner was not loaded for it (NCCL_TUNER_PLUGIN must name this "
		       "library): NCCL would choose the channel count per collective";
	else if (unpinned)
		*why = "NCCL offered no Ring/Simple for an allreduce, so the ckm tuner could not "
		       "pin it";
	else if (off)
		*why = "NCCL asked the tuner about an allreduce that is not the next bucket of "
		       "CKM_NCCL_BUCKETS (another allreduce, or grouped ones): the model path "
		       "cannot place it (CKM_NCCL_IDENTITY=profiler can)";
	return found && !unpinned && !off;
}

typedef struct {
	const char *name;
	ncclResult_t (*init)(void **, uint64_t, size_t, size_t, ncclDebugLogger_t,
			     ckm_nvl_domain_info_v5 *, void *);
	ncclResult_t (*getCollInfo)(void *, int, size_t, int, float **, int, int, int, int *);
	ncclResult_t (*finalize)(void *);
} ckm_tuner_v5_t;

EXPORT const ckm_tuner_v5_t ncclTunerPlugin_v5 = {
	.name = "ckm", .init = t_init, .getCollInfo = t_get_coll_info, .finalize = t_finalize,
};
