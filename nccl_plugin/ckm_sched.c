/* The ring allreduce schedule per NCCL release; see ckm_sched.h. Each step names the NCCL
 * source it follows (release v2.29.7-1 line numbers; docs/nccl_plugin.md has every release). */
#include "ckm_sched.h"

static uint64_t div_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
static uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t max64(uint64_t a, uint64_t b) { return a > b ? a : b; }

#define ELT 4 /* sizeof(float) */

int ckm_sched_release(int v)
{
	/* Version ranges whose schedule code was compared line by line (docs/nccl_plugin.md). */
	if (v >= 22803 && v <= 22809)
		return CKM_REL_2_28;
	if (v >= 22902 && v <= 23007)
		return CKM_REL_2_29;
	return CKM_REL_NONE;
}

const char *ckm_sched_supported(void) { return "2.28.3-2.28.9 and 2.29.2-2.30.7"; }

/* scheduleCollTasksToPlan (enqueue.cc:571-790) for a plan holding this one allreduce:
 * cells of MinTrafficPerChannel / trafficPerByte bytes spread over the channels. */
struct cbd {
	int lo, n, mid;
	uint64_t count_lo, count_mid, count_hi;
};

static void plan(const struct ckm_sched *s, uint64_t count, struct cbd *o)
{
	const uint64_t tpb = 2; /* ncclFuncTrafficPerByte(AllReduce) (enqueue.cc:93-100) */
	const uint64_t min_traffic = s->release == CKM_REL_2_28 ? 16 << 10 : 32 << 10;
	/* NCCL splits by min(task->nMaxChannels, comm->nChannels): the tuner's channel count
	 * and the communicator's. One number stands for both here, so this assumes they are
	 * equal. The tuner pins nMaxChannels to CKM_NCCL_CHANNELS (ckm_tuner.c); what guards
	 * comm->nChannels is the net plugin's check that the communicator opened exactly
	 * CKM_NCCL_CHANNELS send connections (first_checks in ckm_tagging.c; the connect side
	 * refuses a connection beyond that count), before anything is labelled. */
	const uint64_t nmax = (uint64_t)s->channels;
	uint64_t traffic = max64(min_traffic, count * ELT * tpb);
	uint64_t per_ch = s->release == CKM_REL_2_28 ? max64(min_traffic, traffic / nmax)
						     : div_up(traffic / nmax, 16) * 16;
	uint64_t cell = div_up(div_up(min_traffic, tpb), 16) * 16;
	uint64_t epc = cell / ELT, cells = div_up(count * ELT, cell), tcell = cell * tpb;
	uint64_t cpc = min64(cells, div_up(per_ch, tcell));
	uint64_t lo_cells = nmax == 1 ? cells : min64(cells, div_up(per_ch, tcell));
	long mid = (long)((cells - lo_cells) / cpc);
	uint64_t hi_cells = (cells - lo_cells) % cpc;
	long n = (lo_cells != 0) + mid + (hi_cells != 0);
	int ch = 0;
	if ((long)nmax < n) { /* overflowed the channels */
		mid = (long)nmax - 2;
		cpc = (cells - lo_cells) / (uint64_t)(mid + 1);
		hi_cells = cpc + (cells - lo_cells) % (uint64_t)(mid + 1);
	}
	if (hi_cells == 0 && mid != 0) {
		hi_cells = cpc;
		mid -= 1;
	}
	if (lo_cells == 0) {
		ch += 1;
		if (mid == 0) {
			lo_cells = hi_cells;
			hi_cells = 0;
		} else {
			lo_cells = cpc;
			mid -= 1;
		}
	}
	o->count_mid = mid ? cpc * epc : 0;
	o->count_lo = lo_cells * epc;
	o->count_hi = hi_cells * epc;
	if (o->count_hi)
		o->count_hi -= cells * epc - count;
	else
		o->count_lo -= cells * epc - count;
	o->lo = ch;
	o->mid = (int)mid;
	o->n = (o->count_lo != 0) + (int)mid + (hi_cells != 0);
}

/* calcCollChunking (enqueue.cc:2091-2265) for Ring/Simple on one channel: chunkSize =
 * buffSize / NCCL_STEPS * chunkSteps, floored to the grain; in elements. */
static uint64_t chunk_elems(const struct ckm_sched *s)
{
	uint64_t bytes = s->buffsize / CKM_SCHED_STEPS * CKM_SCHED_CHUNKSTEPS;
	return bytes / CKM_SCHED_GRAIN * CKM_SCHED_GRAIN / ELT;
}

uint64_t ckm_sched_prof_chunk(const struct ckm_sched *s)
{
	return chunk_elems(s) * ELT * CKM_SCHED_SLICESTEPS; /* profiler.cc:580 */
}

int ckm_sched_nchannels(const struct ckm_sched *s, uint64_t count)
{
	struct cbd p;
	if (!count || s->nranks < 2)
		return 0;
	plan(s, count, &p);
	return p.n;
}

/* ncclCollCbdPart (device.h:330-355). */
int ckm_sched_part(const struct ckm_sched *s, uint64_t count, int ch, struct ckm_part *o)
{
	struct cbd p;
	if (!count || s->nranks < 2 || s->release == CKM_REL_NONE)
		return 0;
	plan(s, count, &p);
	int hi = p.lo + p.n - 1;
	if (ch < p.lo || ch > hi)
		return 0;
	if (ch == p.lo) {
		o->offset = 0;
		o->count = p.count_lo;
	} else if (ch == hi) {
		o->offset = p.count_lo + (uint64_t)p.mid * p.count_mid;
		o->count = p.count_hi;
	} else {
		o->offset = p.count_lo + (uint64_t)(ch - p.lo - 1) * p.count_mid;
		o->count = p.count_mid;
	}
	o->chunk = chunk_elems(s);
	/* proxy nLoops = DIVUP(nBytes, nChannels(1) * nRanks * chunkSize) (enqueue.cc:2239) */
	o->loops = div_up(o->count, (uint64_t)s->nranks * o->chunk);
	return 1;
}

uint64_t ckm_sched_sends(const struct ckm_sched *s, uint64_t count, int ch)
{
	struct ckm_part p;
	if (!ckm_sched_part(s, count, ch, &p))
		return 0;
	/* nsteps = 2(N-1) * nLoops * chunkSteps, one isend per sliceSteps (net.cc:1281,1346) */
	return p.loops * 2 * (uint64_t)(s->nranks - 1) * CKM_SCHED_SLICES;
}

void ckm_sched_slice(const struct ckm_sched *s, uint64_t count, int ch, uint64_t i,
		     struct ckm_slice *out)
{
	struct ckm_part p;
	out->offset = out->count = 0;
	out->final = 0;
	if (!ckm_sched_part(s, count, ch, &p))
		return;
	int64_t n = s->nranks, ix = s->rank; /* ring index: rank order, checked at setup */
	uint64_t per = 2 * (uint64_t)(n - 1) * CKM_SCHED_SLICES;
	uint64_t loop = i / per, op = (i % per) / CKM_SCHED_SLICES, sl = i % CKM_SCHED_SLICES;
	/* runRing (all_reduce.h:14-84): loops of nranks * chunkCount elements; the last one
	 * shrinks chunkCount to alignUp(divUp(remCount, nranks), 16 / sizeof(T)). */
	int64_t loop_count = n * (int64_t)p.chunk, elem = (int64_t)loop * loop_count;
	int64_t rem = (int64_t)p.count - elem, chunk_count = (int64_t)p.chunk;
	if (rem < loop_count)
		chunk_count = (int64_t)(div_up((uint64_t)div_up((uint64_t)rem, (uint64_t)n), 4) * 4);
	int64_t chunk;
	if (op == 0)
		chunk = (ix + n - 1) % n;                      /* directSend */
	else if ((int64_t)op < n - 1)
		chunk = (ix + n - (int64_t)op - 1) % n;        /* directRecvReduceDirectSend, j = op+1 */
	else if ((int64_t)op == n - 1)
		chunk = ix;                                    /* directRecvReduceCopyDirectSend */
	else
		chunk = (ix + n - ((int64_t)op - n + 1)) % n;  /* directRecvCopyDirectSend, j = op-n+1 */
	int64_t chunk_off = chunk * chunk_count;
	int64_t nelem = chunk_count < rem - chunk_off ? chunk_count : rem - chunk_off;
	if (nelem < 0)
		nelem = 0; /* genericOp: nelem = nelem < 0 ? 0 : nelem (prims_simple.h:193) */
	/* genericOp's slices (prims_simple.h:194-195,230,308): two, each at most sliceSize. */
	int64_t step_elems = (int64_t)(s->buffsize / CKM_SCHED_STEPS / ELT);
	int64_t slice = (int64_t)div_up((uint64_t)nelem, 16 * CKM_SCHED_SLICES) * 16;
	if (slice < step_elems * CKM_SCHED_SLICESTEPS / 32)
		slice = step_elems * CKM_SCHED_SLICESTEPS / 32;
	int64_t first = slice < nelem ? slice : nelem;
	int64_t a = sl == 0 ? 0 : first;
	int64_t b = sl == 0 ? first : first + (slice < nelem - first ? slice : nelem - first);
	out->offset = p.offset + (uint64_t)(elem + chunk_off + a);
	out->count = (uint64_t)(b - a);
	out->final = (int64_t)op == n - 1;
}
