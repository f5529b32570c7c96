"""The ring-schedule model of NCCL's ring allreduce with the Simple protocol, in Python:
the same model nccl_plugin/ckm_sched.c implements (docs/nccl_plugin.md, "The schedule
model"). The harness drives the plugin by it: per channel, per loop, the kernel's steps
send, N-2 x recvReduceSend, recvReduceCopySend (fully reduced), N-2 x recvCopySend, recv,
each moved in SLICES slices (one isend/irecv per slice)."""

from __future__ import annotations

from dataclasses import dataclass

STEPS = 8  # NCCL_STEPS
CHUNKSTEPS = 4  # ALLREDUCE_CHUNKSTEPS
SLICES = 2  # ALLREDUCE_CHUNKSTEPS / ALLREDUCE_SLICESTEPS
ALIGN = 4  # elements (16 bytes)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _div_up(a, b) * b


@dataclass(frozen=True)
class Ring:
    nranks: int
    channels: int
    buffsize: int  # NCCL_BUFFSIZE in bytes

    @property
    def chunk(self) -> int:
        """Elements (float32) per chunk: CHUNKSTEPS steps of buffsize / STEPS bytes."""
        return self.buffsize // STEPS * CHUNKSTEPS // 4

    def loops(self, count: int) -> int:
        return _div_up(count, self.channels * self.nranks * self.chunk) if count else 0

    def kernel_steps(self) -> int:
        """Kernel steps per loop: 2N-1 (the first only sends, the last only receives)."""
        return 2 * self.nranks - 1

    def step_chunk(self, rank: int, step: int) -> int:
        """Which ring chunk kernel step ``step`` of ``rank`` works on."""
        n = self.nranks
        if step == n - 1:
            return rank  # recvReduceCopySend: the result is final here
        if step == 2 * n - 2:
            return (rank + 1) % n  # the final recv
        if step < n - 1:
            return (rank - 1 - step) % n  # send, then recvReduceSend
        return (rank - (step - n + 1)) % n  # recvCopySend

    def chunk_range(self, count: int, loop: int, ch: int, chunk: int) -> tuple[int, int]:
        """Elements [start, stop) of the collective's buffer that a chunk covers."""
        n, c = self.nranks, self.channels
        grid = loop * c * n * self.chunk
        real = _round_up(min(self.chunk, _div_up(count - grid, c * n)), ALIGN)
        off = grid + ch * n * real + chunk * real
        nelem = max(0, min(real, count - off))
        return off, off + nelem

    @staticmethod
    def slices(start: int, stop: int) -> list[tuple[int, int]]:
        nelem = stop - start
        se = _round_up(_div_up(nelem, SLICES), ALIGN)
        return [(start + min(s * se, nelem), start + min((s + 1) * se, nelem))
                for s in range(SLICES)]

    def sends(self, rank: int, count: int, ch: int) -> list[tuple[int, int, bool]]:
        """Every isend on channel ``ch``'s connection, in order: (start, stop, final)."""
        out = []
        for loop in range(self.loops(count)):
            for step in range(self.kernel_steps() - 1):
                lo, hi = self.chunk_range(count, loop, ch, self.step_chunk(rank, step))
                out += [(a, b, step == self.nranks - 1) for a, b in self.slices(lo, hi)]
        return out
