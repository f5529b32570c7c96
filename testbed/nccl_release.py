"""What NCCL itself does for a ring allreduce (Simple protocol), per release, written from
NVIDIA/nccl's source for the harness (checkmate.testbed.nccl_harness), separately from the
plugin's C model (nccl_plugin/ckm_sched.c): the tests pass only where the two agree.

Three layers, each as the release's source has it (file:line of v2.29.7-1 here; every
release's lines are in docs/nccl_plugin.md, "The schedule per release"):

- host planning: ``plan()`` is scheduleCollTasksToPlan (src/enqueue.cc:571-790) for the
  tasks of one kernel plan -- cells spread over the channels by traffic -- and
  calcCollChunking (src/enqueue.cc:2091-2265) for each channel's chunk and proxy steps;
  several tasks in one plan is collective packing;
- kernel: ``kernel_ops()`` is runRing (src/device/all_reduce.h:14-84): per channel part,
  loops of nranks chunks, 2N-1 primitive calls per loop; ``slices()`` is genericOp
  (src/device/prims_simple.h:193-308): each call moves SlicePerChunk=2 slices;
- proxy: one isend per slice of sliceSteps=2 steps, tagged with the sender's own rank
  (src/transport/net.cc:1237-1390, isend at :1342), receives of stepSize*sliceSteps bytes
  tagged with the peer's rank (:1480-1488), and the profiler's ProxyOp nSteps =
  DIVUP(nsteps, sliceSteps), chunkSize = chunkSize * sliceSteps, ProxyStep step =
  DIVUP(stepId, sliceSteps) (src/plugin/profiler.cc:513-600).
"""

from __future__ import annotations

from dataclasses import dataclass

NCCL_STEPS = 8  # src/include/device.h
CHUNKSTEPS = NCCL_STEPS // 2  # ALLREDUCE_CHUNKSTEPS, src/include/collectives.h:20
SLICESTEPS = NCCL_STEPS // 4  # ALLREDUCE_SLICESTEPS, src/include/collectives.h:19
SLICE_PER_CHUNK = CHUNKSTEPS // SLICESTEPS  # ProtoSimple<2, 2>, src/device/all_reduce.h:236
GRAIN = 512  # ncclProtoGrainSize(NCCL_PROTO_SIMPLE), src/include/device.h:322-327
TRAFFIC_PER_BYTE = 2  # ncclFuncTrafficPerByte(ncclFuncAllReduce), src/enqueue.cc:93-100


@dataclass(frozen=True)
class Release:
    """A range of NCCL releases whose allreduce schedule code is the same."""

    name: str
    lo: int  # version codes, inclusive
    hi: int
    min_traffic: int  # MinTrafficPerChannel in scheduleCollTasksToPlan
    rounded: bool  # trafficPerChannel = divUp(traffic / nChannels, 16) * 16 (else max(min, ..))
    profiler_v6: bool


#: 2.28: MinTrafficPerChannel = 16K, trafficPerChannel = max(16K, traffic / nChannels)
#: (v2.28.9-1 src/enqueue.cc); 2.29.2 .. 2.30.7: 32K and divUp(traffic / nChannels, 16) * 16
#: (v2.29.7-1 src/enqueue.cc:581,614). Profiler v6 from 2.29 (src/include/plugin/profiler/).
RELEASES = (
    Release("2.28", 22803, 22809, 16 << 10, False, False),
    Release("2.29", 22902, 23007, 32 << 10, True, True),
)


def release_of(version: int) -> Release | None:
    return next((r for r in RELEASES if r.lo <= version <= r.hi), None)


def version_code(text: str) -> int:
    """'2.29.7' -> 22907 (NCCL_VERSION_CODE for 2.9 and later)."""
    major, minor, patch = (int(x) for x in text.split("."))
    return major * 10000 + minor * 100 + patch


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ProxyOp:
    """One channel's share of one collective, as the host hands it to the proxy."""

    task: int  # index of the collective in its plan
    channel: int
    part_offset: int  # elements (ncclCollCbdPart's partOffset)
    part_count: int
    chunk_count: int  # elements
    nsteps: int  # proxy steps: 2(N-1) * nLoops * chunkSteps
    chunk_bytes: int

    @property
    def prof_nsteps(self) -> int:
        return _div_up(self.nsteps, SLICESTEPS)

    @property
    def prof_chunk(self) -> int:
        return self.chunk_bytes * SLICESTEPS


def plan(counts: list[int], nranks: int, n_max_channels: int, comm_channels: int,
         buffsize: int, rel: Release, elt: int = 4) -> tuple[list[ProxyOp], list[int]]:
    """The proxy ops of one kernel plan holding allreduces of ``counts`` (in plan order),
    and each task's channel count (task->nChannels, what the Coll event reports)."""
    n_ch = 0
    traffic = 0
    for c in counts:  # the budget pass (enqueue.cc:585-598)
        traffic += max(rel.min_traffic, c * elt * TRAFFIC_PER_BYTE)
        n_ch = min(n_ch + n_max_channels, comm_channels)
    nmax = comm_channels  # nMaxChannels[kind] for neither collnet nor nvls
    if rel.rounded:
        per_ch = _div_up(traffic // n_ch, 16) * 16
    else:
        per_ch = max(rel.min_traffic, traffic // n_ch)
    ops: list[ProxyOp] = []
    used: list[int] = []
    channel, current = 0, 0
    cell = _div_up(_div_up(rel.min_traffic, TRAFFIC_PER_BYTE), 16) * 16
    epc, t_cell, t_elem = cell // elt, cell * TRAFFIC_PER_BYTE, elt * TRAFFIC_PER_BYTE
    for task, count in enumerate(counts):  # enqueue.cc:649-790
        cells = _div_up(count * elt, cell)
        cpc = min(cells, _div_up(per_ch, t_cell))
        lo = cells if channel + 1 == nmax else min(cells, _div_up(per_ch - current, t_cell))
        mid = (cells - lo) // cpc
        hi = (cells - lo) % cpc
        n = (lo != 0) + mid + (hi != 0)
        if nmax < channel + n:
            mid = nmax - channel - 2
            cpc = (cells - lo) // (mid + 1)
            hi = cpc + (cells - lo) % (mid + 1)
        if hi == 0 and mid != 0:
            hi, mid = cpc, mid - 1
        if lo == 0:
            channel += 1
            if mid == 0:
                lo, hi = hi, 0
            else:
                lo, mid = cpc, mid - 1
        count_mid = cpc * epc if mid else 0
        count_lo, count_hi = lo * epc, hi * epc
        if count_hi:
            count_hi -= cells * epc - count
        else:
            count_lo -= cells * epc - count
        n = (count_lo != 0) + mid + (hi != 0)
        used.append(n)
        ch_lo, ch_hi = channel, channel + n - 1
        if count_hi:
            channel += n - 1
            current = hi * epc * t_elem
        elif mid:
            channel += n
            current = 0
        else:
            current += lo * epc * t_elem
        if current >= per_ch and channel + 1 != nmax:
            channel, current = channel + 1, 0
        for ch in range(ch_lo, ch_hi + 1):
            if ch == ch_lo:
                off, part = 0, count_lo
            elif ch == ch_hi:
                off, part = count_lo + mid * count_mid, count_hi
            else:
                off, part = count_lo + (ch - ch_lo - 1) * count_mid, count_mid
            ops.append(_chunking(task, ch, off, part, nranks, buffsize, elt))
    return ops, used


def _chunking(task: int, ch: int, off: int, part: int, nranks: int, buffsize: int,
              elt: int) -> ProxyOp:
    """calcCollChunking for Ring/Simple on one channel (nChannels = 1)."""
    step = buffsize // NCCL_STEPS
    chunk = step * CHUNKSTEPS // GRAIN * GRAIN
    loops = _div_up(part * elt, nranks * chunk)  # pattern RingTwice: nchunksPerLoop = nranks
    return ProxyOp(task, ch, off, part, chunk // elt, 2 * (nranks - 1) * loops * CHUNKSTEPS,
                   chunk)


#: primitive kinds of runRing, with whether they receive and send
SEND, RRS, RRCS, RCS, RECV = "send", "recvReduceSend", "recvReduceCopySend", "recvCopySend", \
    "recv"
RECEIVES = {RRS, RRCS, RCS, RECV}
SENDS = {SEND, RRS, RRCS, RCS}


def kernel_ops(op: ProxyOp, nranks: int, ring_index: int) -> list[tuple[str, int, int, int]]:
    """runRing's primitive calls on one channel: (kind, loop, offset, nelem), offsets in
    the collective's buffer; nelem may be <= 0 (genericOp makes it 0)."""
    out = []
    chunk_count = op.chunk_count
    loop_count = nranks * chunk_count
    elem, loop = 0, 0
    while elem < op.part_count:
        rem = op.part_count - elem
        if rem < loop_count:
            chunk_count = _div_up(_div_up(rem, nranks), 4) * 4  # alignUp(.., 16/sizeof(T))

        def at(chunk: int, chunk_count: int = chunk_count, elem: int = elem,
               rem: int = rem) -> tuple[int, int]:
            chunk_off = chunk * chunk_count
            return op.part_offset + elem + chunk_off, min(chunk_count, rem - chunk_off)

        def mod(r: int) -> int:
            return r - (nranks if r >= nranks else 0)

        out.append((SEND, loop, *at(mod(ring_index + nranks - 1))))
        for j in range(2, nranks):
            out.append((RRS, loop, *at(mod(ring_index + nranks - j))))
        out.append((RRCS, loop, *at(ring_index)))
        for j in range(1, nranks - 1):
            out.append((RCS, loop, *at(mod(ring_index + nranks - j))))
        out.append((RECV, loop, *at(mod(ring_index + 1))))
        elem += loop_count
        loop += 1
    return out


def slices(nelem: int, buffsize: int, elt: int = 4) -> list[tuple[int, int]]:
    """genericOp's slices of one call: (offset within the call, elements), always
    SlicePerChunk of them, empty ones included (their connFifo size is 0)."""
    nelem = max(nelem, 0)
    step_elems = buffsize // NCCL_STEPS // elt
    size = max(_div_up(nelem, 16 * SLICE_PER_CHUNK) * 16, step_elems * SLICESTEPS // 32)
    out, offset = [], 0
    for _ in range(SLICE_PER_CHUNK):
        n = min(size, nelem - offset)
        out.append((offset, n))
        offset += n
    return out
