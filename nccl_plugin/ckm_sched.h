/* The ring-schedule model: which isend of NCCL's ring allreduce (NCCL_ALGO=Ring,
 * NCCL_PROTO=Simple) carries which elements, and which of them are fully reduced
 * (docs/nccl_plugin.md, "The schedule model"). testbed/nccl_schedule.py is the same model
 * in Python; the harness drives the plugin with it and tests compare the two. */
#ifndef CKM_SCHED_H
#define CKM_SCHED_H

#include <stdint.h>

#define CKM_SCHED_STEPS 8        /* NCCL_STEPS */
#define CKM_SCHED_CHUNKSTEPS 4   /* ALLREDUCE_CHUNKSTEPS = NCCL_STEPS / 2 */
#define CKM_SCHED_SLICES 2       /* slices per chunk = ALLREDUCE_CHUNKSTEPS / SLICESTEPS */
#define CKM_SCHED_ALIGN 4        /* elements: chunk and slice sizes round up to 16 bytes */

struct ckm_sched {
	int nranks, rank, channels;
	uint64_t chunk; /* elements per chunk: (buffsize / NCCL_STEPS) * CHUNKSTEPS / 4 */
};

/* One isend as the model predicts it: elements [offset, offset + count) of the
 * collective's buffer; final = 1 when they are fully reduced (first all-gather hop). */
struct ckm_slice {
	uint64_t offset, count;
	int final;
};

/* isends per channel connection for one allreduce of `count` float32 elements. */
uint64_t ckm_sched_sends(const struct ckm_sched *s, uint64_t count);
/* The i-th isend (0-based) on channel `ch`'s connection for that allreduce. */
void ckm_sched_slice(const struct ckm_sched *s, uint64_t count, int ch, uint64_t i,
		     struct ckm_slice *out);

#endif
