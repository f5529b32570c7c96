/* The ring allreduce schedule model; see ckm_sched.h and docs/nccl_plugin.md. */
#include "ckm_sched.h"

static uint64_t div_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
static uint64_t round_up(uint64_t a, uint64_t b) { return div_up(a, b) * b; }
static uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* Sending kernel steps per loop: send, N-2 x recvReduceSend, recvReduceCopySend (the
 * final result), N-2 x recvCopySend; the last step (recv) sends nothing. */
static uint64_t ops_per_loop(const struct ckm_sched *s) { return 2 * (uint64_t)(s->nranks - 1); }

uint64_t ckm_sched_sends(const struct ckm_sched *s, uint64_t count)
{
	if (s->nranks < 2 || count == 0)
		return 0;
	uint64_t loop = (uint64_t)s->channels * s->nranks * s->chunk;
	return div_up(count, loop) * ops_per_loop(s) * CKM_SCHED_SLICES;
}

void ckm_sched_slice(const struct ckm_sched *s, uint64_t count, int ch, uint64_t i,
		     struct ckm_slice *out)
{
	uint64_t n = (uint64_t)s->nranks, per = ops_per_loop(s) * CKM_SCHED_SLICES;
	uint64_t loop = i / per, op = (i % per) / CKM_SCHED_SLICES, sl = i % CKM_SCHED_SLICES;
	uint64_t grid = loop * (uint64_t)s->channels * n * s->chunk;
	uint64_t real = min64(s->chunk, div_up(count - grid, (uint64_t)s->channels * n));
	real = round_up(real, CKM_SCHED_ALIGN);
	/* The chunk (ring position) this op works on, for ring index r = rank. */
	uint64_t r = (uint64_t)s->rank, chunk;
	if (op == 0)
		chunk = (r + n - 1) % n;              /* send: push own data */
	else if (op < n - 1)
		chunk = (r + 2 * n - 1 - op) % n;     /* recvReduceSend */
	else if (op == n - 1)
		chunk = r;                             /* recvReduceCopySend: fully reduced */
	else
		chunk = (r + 2 * n - 1 - op) % n;     /* recvCopySend: r - (op - n + 1) */
	uint64_t off = grid + (uint64_t)ch * n * real + chunk * real;
	uint64_t nelem = off < count ? min64(real, count - off) : 0;
	uint64_t se = round_up(div_up(nelem, CKM_SCHED_SLICES), CKM_SCHED_ALIGN);
	uint64_t a = min64(sl * se, nelem), b = min64((sl + 1) * se, nelem);
	out->offset = off + a;
	out->count = b - a;
	out->final = op == n - 1;
}
