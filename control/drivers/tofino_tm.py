"""Tofino 1 ingress buffer carving for the lossless ckm class (numbers: docs/pfc.md).

The SDE carves the buffer at device-add; a deployment adds what the lossless class needs
next to that carving instead of shrinking it, the way Tofino PFC deployments do:

- each lossless PPG takes a small guaranteed minimum (one max frame, so one frame always
  gets in), may grow to its xoff cells in a dedicated application pool (LOSSLESS_POOL,
  PFC fires when that share is used up), and absorbs the headroom in the global skid pool;
- LOSSLESS_POOL is sized for every PPG reaching its xoff at once, the skid pool for every
  PPG's full headroom at once (the SDE allows oversubscribing it; we do not); the new
  PPGs' guaranteed cells come out of the buffer the default carving leaves free (it carves
  100K of 280K cells; Tofino 1 has no settable global gmin pool: tm_api_pool.c:388-390);
- IG_APP_POOL_0, where every default PPG (all lossy traffic) lives, is not touched.

The defaults below are the SDE's own, from the open-source Tofino SDE
(github.com/p4lang/open-p4studio at 1f97778f9ad5c8165bfce552fffe27c69887756b),
pkgsrc/bf-drivers/src/traffic_mgr/init/tm_tofino.h and tm_tofino_default.h, and the table
definitions from pkgsrc/bf-drivers/src/bf_rt/bf_rt_tm/bf_rt_tm_tf1.json; the line numbers
are given per constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from checkmate.control import pfc
from checkmate.control.plan import Plan
from checkmate.errors import CheckmateError

#: tm_tofino.h:31 BF_TM_TOFINO_BUFFER_CELLS (Tofino 1, not the "lite" SKUs: 260K, line 32).
BUFFER_CELLS = 280 * 1024
#: tm_tofino.h:33 BF_TM_TOFINO_CELL_SIZE.
CELL_BYTES = 80
#: tm_tofino.h:36-39: 18 port groups x 4 ports + 1 mirror port per pipe, 4 pipes; the
#: default carving counts all four pipes whatever the SKU.
PORTS_PER_PIPE = 18 * 4 + 1
MAU_PIPES = 4
#: tm_tofino_default.h:42 BF_TM_TOFINO_TOTAL_CELLS_FOR_DEFAULT_CARVING.
DEFAULT_CARVING_CELLS = 100 * 1024
#: tm_tofino_default.h:45-49 BF_TM_CELLS_FOR_2_PKT = 2 x 1600 B / cell, the gmin of each
#: default PPG (BF_TM_DEFAULT_PPG_LMT, line 57).
DEFAULT_PPG_GMIN_CELLS = 2 * 1600 // CELL_BYTES
#: tm_tofino_default.h:54 BF_TM_SKID_POOL_SIZE (also: tm_api_pool.c:285 "default skid pool
#: size is set zero").
DEFAULT_SKID_CELLS = 0
#: tm_tofino_default.h:60 BF_TM_NEG_MIRROR_POOL_SIZE.
DEFAULT_MIRROR_CELLS = 20 * PORTS_PER_PIPE
#: tm_tofino_default.h:63-65 BF_TM_IG_DEFAULT_PPG_GMIN_POOL_SIZE.
DEFAULT_GMIN_CELLS = DEFAULT_PPG_GMIN_CELLS * PORTS_PER_PIPE * MAU_PIPES
#: tm_tofino_default.h:71-74 BF_TM_IG_APP_POOL_0_SIZE (non-SLT build).
DEFAULT_APP_POOL_0_CELLS = DEFAULT_CARVING_CELLS - (
    DEFAULT_GMIN_CELLS + DEFAULT_SKID_CELLS + DEFAULT_MIRROR_CELLS)

#: The default application pool: every default PPG draws from it; left as the SDE sized it.
DEFAULT_POOL = "IG_APP_POOL_0"
#: The dedicated pool of the lossless PPGs (unused by the default carving).
LOSSLESS_POOL = "IG_APP_POOL_1"
#: bf_rt_tm_tf1.json:789 and 792: pool.cfg key choices for the skid pool (pool.cfg's mod of
#: it calls bf_tm_pool_skid_size_set: bf_rt_tm_table_impl_pool.cpp:29-30) and the global
#: gmin (settable on Tofino 2 and later only, tm_api_pool.c:388-390).
SKID_POOL = "IG_SKID_POOL"
GMIN_POOL = "IG_EG_GUARANTEED_MIN"


@dataclass(frozen=True)
class PpgCells:
    """One lossless PPG's thresholds, in cells."""

    guaranteed: int  # gmin: one max frame
    pool_max: int  # share in LOSSLESS_POOL, static (dynamic_baf DISABLE): PFC once used (xoff)
    hysteresis: int  # RESUME once usage fell this far below the limit (xoff - xon)
    skid: int  # headroom, from the global skid pool


@dataclass(frozen=True)
class Carving:
    """The pool sizes a deployment sets; the default pool keeps DEFAULT_APP_POOL_0_CELLS."""

    lossless_pool: int
    skid_pool: int
    gmin_pool: int  # accounted, not written (see the module docstring)

    @property
    def carved(self) -> int:
        """Ingress cells accounted for after the change (default pool + the three above +
        mirror), to be compared with the chip's BUFFER_CELLS."""
        return (DEFAULT_APP_POOL_0_CELLS + DEFAULT_MIRROR_CELLS + self.lossless_pool
                + self.skid_pool + self.gmin_pool)


def ppg_cells(s: pfc.PfcSettings, mtu: int) -> PpgCells:
    frame = math.ceil((mtu + pfc.FRAME_OVERHEAD) / CELL_BYTES)
    return PpgCells(guaranteed=frame, pool_max=s.xoff_cells,
                    hysteresis=s.xoff_cells - s.xon_cells, skid=s.headroom_cells)


def carving(plan: Plan) -> Carving:
    """Pool sizes for the plan's lossless PPGs; refuses a plan the buffer cannot hold."""
    cells = [ppg_cells(p.pfc, p.mtu) for p in plan.ports]
    out = Carving(lossless_pool=sum(c.pool_max for c in cells),
                  skid_pool=DEFAULT_SKID_CELLS + sum(c.skid for c in cells),
                  gmin_pool=DEFAULT_GMIN_CELLS + sum(c.guaranteed for c in cells))
    if out.carved > BUFFER_CELLS:
        raise CheckmateError(
            f"switch {plan.switch}: the lossless class needs {out.carved} buffer cells with "
            f"the default carving, Tofino has {BUFFER_CELLS}: fewer ports, shorter cables "
            "or a smaller MTU")
    return out
