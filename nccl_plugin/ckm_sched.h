/* The ring-schedule model: which isend of NCCL's ring allreduce (algorithm Ring, protocol
 * Simple, float32) carries which elements, per supported NCCL release, derived from that
 * release's source (docs/nccl_plugin.md, "The schedule per release", cited by file:line).
 *
 * Inputs NCCL fixes per communicator: ranks, this rank's ring index, the channel count the
 * ckm tuner pins (nMaxChannels = comm->nChannels = channels) and NCCL_BUFFSIZE. One
 * collective per kernel plan (no packing): the host splits it over channels (enqueue.cc,
 * scheduleCollTasksToPlan), the kernel loops over each channel's part (all_reduce.h,
 * runRing), and each kernel step moves two slices (prims_simple.h, genericOp), one isend each
 * (net.cc, sendProxyProgress). testbed/nccl_release.py is the NCCL side written separately
 * from NCCL's source: the tests make the two meet. */
#ifndef CKM_SCHED_H
#define CKM_SCHED_H

#include <stdint.h>

#define CKM_SCHED_STEPS 8        /* NCCL_STEPS */
#define CKM_SCHED_CHUNKSTEPS 4   /* ALLREDUCE_CHUNKSTEPS = NCCL_STEPS / 2 */
#define CKM_SCHED_SLICESTEPS 2   /* ALLREDUCE_SLICESTEPS = NCCL_STEPS / 4 */
#define CKM_SCHED_SLICES 2       /* slices per chunk = CHUNKSTEPS / SLICESTEPS */
#define CKM_SCHED_GRAIN 512      /* ncclProtoGrainSize(NCCL_PROTO_SIMPLE), bytes */

/* Release profiles: releases whose schedule code is identical share one. */
enum { CKM_REL_NONE = 0, CKM_REL_2_28 = 1, CKM_REL_2_29 = 2 };

struct ckm_sched {
	int nranks, rank, channels, release;
	uint64_t buffsize; /* NCCL_BUFFSIZE: comm->buffSizes[NCCL_PROTO_SIMPLE] */
};

/* One channel's share of a collective, in float32 elements. */
struct ckm_part {
	uint64_t offset, count, chunk; /* partOffset, partCount, chunkCount (ncclCollCbdPart) */
	uint64_t loops;                /* kernel loops = proxy nLoops */
};

/* One isend as the model predicts it: elements [offset, offset + count) of the
 * collective's buffer; final = 1 when they are fully reduced (first all-gather hop). */
struct ckm_slice {
	uint64_t offset, count;
	int final;
};

/* The profile of an NCCL version code (major*10000 + minor*100 + patch), or CKM_REL_NONE. */
int ckm_sched_release(int version);
/* "2.28.3-2.28.9, 2.29.2-2.30.7": the supported versions, for messages. */
const char *ckm_sched_supported(void);
/* Channels the collective runs on (task->nChannels, what the profiler's Coll reports). */
int ckm_sched_nchannels(const struct ckm_sched *s, uint64_t count);
/* Channel ch's part; 0 when the collective does not use that channel. */
int ckm_sched_part(const struct ckm_sched *s, uint64_t count, int ch, struct ckm_part *out);
/* isends on channel ch's connection for one allreduce of `count` elements. */
uint64_t ckm_sched_sends(const struct ckm_sched *s, uint64_t count, int ch);
/* The proxy op's chunk size in bytes as the profiler reports it (chunkSize * sliceSteps). */
uint64_t ckm_sched_prof_chunk(const struct ckm_sched *s);
/* The i-th isend (0-based) on channel ch's connection for that allreduce. */
void ckm_sched_slice(const struct ckm_sched *s, uint64_t count, int ch, uint64_t i,
		     struct ckm_slice *out);

#endif
