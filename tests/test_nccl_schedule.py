"""The plugin's C schedule (nccl_plugin/ckm_sched.c) against NCCL's, as
checkmate.testbed.nccl_release writes it from each release's source: for many collective
sizes, world sizes, ranks, channel counts and buffer sizes, every isend of every channel
has the same elements and the same "fully reduced" mark, the channel count is the one the
Coll event reports and the chunk the ProxyOp event reports. The two were written
separately; this is where a transcription error in either shows. Also: the release
profiles really differ (a plugin on the wrong profile would disagree)."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from checkmate.testbed import nccl_release as nr

REPO = Path(__file__).resolve().parent.parent
REL_ID = {"2.28": 1, "2.29": 2}  # CKM_REL_* in ckm_sched.h


@pytest.fixture(scope="module")
def sched_dump(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("sched") / "sched_dump"
    subprocess.run(["gcc", "-O1", "-Wall", "-Werror", "-o", str(exe),
                    str(REPO / "nccl_plugin/tools/sched_dump.c"),
                    str(REPO / "nccl_plugin/ckm_sched.c")], check=True)
    return exe


def _nccl(rel: nr.Release, n: int, rank: int, ch: int, buff: int, count: int) -> list:
    ops, used = nr.plan([count], n, ch, ch, buff, rel)
    out: list = [("C", used[0], ops[0].prof_chunk)]
    by_ch = {op.channel: op for op in ops}
    for c in range(ch):
        sends = []
        if c in by_ch:
            for kind, _loop, off, nelem in nr.kernel_ops(by_ch[c], n, rank):
                if kind in nr.SENDS:
                    sends += [(off + a, m, int(kind == nr.RRCS))
                              for a, m in nr.slices(nelem, buff)]
            assert len(sends) == by_ch[c].prof_nsteps  # one isend per profiler step
        out.append((c, [(a if m else None, m, f) for a, m, f in sends]))
    return out


def _plugin(exe: Path, cases: list[tuple]) -> list[list]:
    text = "".join(f"{REL_ID[r.name]} {n} {k} {c} {b} {m}\n" for r, n, k, c, b, m in cases)
    lines = iter(subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                                check=True).stdout.splitlines())
    res = []
    for _r, _n, _k, ch, _b, _m in cases:
        _, used, chunk = next(lines).split()
        one: list = [("C", int(used), int(chunk))]
        for _ in range(ch):
            c, k = map(int, next(lines).split())
            sends = []
            for _ in range(k):
                off, m, f = map(int, next(lines).split())
                sends.append((off if m else None, m, f))
            one.append((c, sends))
        res.append(one)
    return res


def test_nccl_schedule_plugin_equals_nccl_source_for_every_release(sched_dump):
    rng = random.Random(22)
    cases = []
    for rel in nr.RELEASES:
        for _ in range(150):
            n = rng.choice([2, 3, 4, 8])
            cases.append((rel, n, rng.randrange(n), rng.choice([1, 2, 4, 8]),
                          rng.choice([1 << 13, 1 << 15, 1 << 17, 1 << 22]),
                          rng.choice([1, 3, 7, 4096, 5003, 20000, 70001, 262144 + 17,
                                      rng.randrange(1, 3_000_000)])))
    got = _plugin(sched_dump, cases)
    for case, mine in zip(cases, got, strict=True):
        assert mine == _nccl(*case), case


def test_nccl_schedule_release_profiles_differ_so_a_wrong_profile_is_caught():
    a = _nccl(nr.RELEASES[0], 4, 0, 4, 1 << 15, 5003)
    b = _nccl(nr.RELEASES[1], 4, 0, 4, 1 << 15, 5003)
    assert a != b
    assert [len(s) for _, s in a[1:]] != [len(s) for _, s in b[1:]]  # other channel use
