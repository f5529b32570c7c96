"""What a testbed run is judged by: two runs bit-identical, shadows equal to trainers,
GoCkpt checkpoints equal to the run, and the reliability counters summed up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.testbed.runner import Run, RunResult

# ----------------------------------------------------------------------------- compare


def _equal(a: Any, b: Any, path: str, diffs: list[str]) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            diffs.append(path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k} (missing on one side)")
            else:
                _equal(a[k], b[k], f"{path}.{k}", diffs)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            diffs.append(f"{path} (length)")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _equal(x, y, f"{path}[{i}]", diffs)
    elif a != b:
        diffs.append(path)


def compare_states(a: dict, b: dict, keys: tuple[str, ...] = ("model", "optimizer")
                   ) -> list[str]:
    """Paths where two saved states differ (tensors by torch.equal); empty if identical."""
    diffs: list[str] = []
    for k in keys:
        _equal(a[k], b[k], k, diffs)
    return diffs


def check_run(run: Run) -> list[str]:
    """Problems with one finished run: ranks that disagree, shadows that differ."""
    import torch

    problems = []
    finals = [torch.load(p, weights_only=False) for p in run.result.finals]
    for r, f in enumerate(finals[1:], start=1):
        d = compare_states(finals[0], f)
        if d:
            problems.append(f"{run.label}: rank {r} differs from rank 0 at {d[:3]}")
    if run.sc.gockpt is not None:
        return problems + _check_gockpt(run, finals[0])
    sd_t = finals[0]["optimizer"]
    lr_t = [g["lr"] for g in sd_t["param_groups"]]
    run.result.shadow_matches_trainer = True
    # every replica set is the trainers' state (of the replicas still running)
    for k in range(len(run.live_sets())):
        shadows = torch.load(run.shadow_state(k), weights_only=False)
        d = compare_states(finals[0], shadows, ("model",))
        d += compare_states({"s": sd_t["state"]}, {"s": shadows["optimizer"]["state"]},
                            ("s",))
        if d:
            run.result.shadow_matches_trainer = False
            which = f"replica set {k}'s" if k else "shadows'"
            problems.append(f"{run.label}: {which} state differs from the trainers' at "
                            f"{d[:3]} (lrs {lr_t})")
    return problems


def gockpt_dir(run: Run) -> Path:
    """Where a GoCkpt scenario's trainers write their checkpoints."""
    return run.dir / "gockpt"


def _check_gockpt(run: Run, final: dict) -> list[str]:
    """GoCkpt runs: the newest checkpoint every partition wrote must be the trainers' state
    of its iteration; when that is the last iteration, compare it with rank 0's final."""
    from checkmate.shadow import checkpoint_load

    try:
        model_sd, optim_sd, it = checkpoint_load.load_full(gockpt_dir(run))
    except CheckmateError as e:
        return [f"{run.label}: no GoCkpt checkpoint: {e}"]
    run.result.gockpt_iteration = it
    if it != run.sc.steps:
        return [f"{run.label}: the newest GoCkpt checkpoint is of iteration {it}, not of the "
                f"last ({run.sc.steps}): choose steps so that a window ends there"]
    d = compare_states(final, {"model": model_sd, "optimizer": optim_sd}, ("model",))
    d += compare_states({"s": final["optimizer"]["state"]}, {"s": optim_sd["state"]}, ("s",))
    run.result.shadow_matches_trainer = not d
    return [f"{run.label}: the GoCkpt checkpoint differs from the trainers at {d[:3]}"] if d \
        else []


def reliability_summary(r: RunResult) -> dict[str, Any]:
    """Commit lag (iterations the trainers were ahead when a shadow committed), repairs,
    re-seeds and drops, from the shadows' statuses and rank 0's step times."""
    import bisect

    first_done: dict[int, float] = {}
    for it, t in r.iter_times:  # a restore repeats iterations: the first time counts
        first_done.setdefault(it, t)
    its = sorted(first_done)
    times = [first_done[i] for i in its]
    lags = []
    for st in r.shadow_status:
        for i, c in st.get("commit_times") or []:
            k = bisect.bisect_right(times, c)
            if i >= 1 and k:
                lags.append(max(0, its[k - 1] - i))
    lags.sort()
    rejoins = []
    for rs in r.restarts:  # the restarted shadow's first commit: where it rejoined
        st = next((s for s in r.shadow_status if s.get("partition") == rs["partition"]), {})
        first, first_t = min(((i, t) for i, t in st.get("commit_times") or []
                              if i > rs["at"]), default=(None, None))
        # seconds: kill -> first commit (process start, registration, re-seed);
        # reseed_seconds: the re-seed asked for -> committed (the time to current);
        # warm_seconds: the kernel compile (or cache load) the restarted process ran at start
        rejoins.append({**rs, "rejoined_at": first,
                        "iterations": None if first is None else first - rs["at"],
                        "seconds": None if first_t is None or "time" not in rs
                        else round(first_t - rs["time"], 2),
                        "reseed_seconds": (st.get("reseed") or {}).get("seconds"),
                        "warm_seconds": st.get("warm_seconds")})
    repair = [s.get("repair") or {} for s in r.shadow_status]
    # What the shadows received as repair answers (payload bytes): complete even when a
    # trainer incarnation was killed before reporting what it sent.
    received = sum(x.get("answer_bytes", 0) for x in repair)
    # Every iteration must be committed by every shadow that was never restarted nor
    # re-seeded (a re-seed replaces the state, skipping the iterations in between; the
    # re-seeds are counted below and the final state is compared with the trainers').
    restarted = {rs["partition"] for rs in r.restarts}
    missing = {}
    for st in r.shadow_status:
        if st.get("partition") in restarted or (st.get("reseed") or {}).get("count"):
            continue
        done = {i for i, _ in st.get("commit_times") or []}
        gone = sorted(set(first_done) - done)
        if gone:
            missing[st.get("partition")] = gone[:20]
    total = max(((s.get("range") or [0, 0])[1] for s in r.shadow_status), default=0)
    replica = 4 * total * len(first_done)
    repair_bytes = received
    return {
        "rejoins": rejoins,
        "commits_missing": missing,
        "commit_lag_max": lags[-1] if lags else None,
        "commit_lag_median": lags[len(lags) // 2] if lags else None,
        "repair_requests": sum(x.get("requests", 0) for x in repair),
        "repair_answers": sum(x.get("answers", 0) for x in repair),
        "repair_gone": sum(x.get("gone", 0) for x in repair),
        "repair_bytes": repair_bytes,
        "replica_bytes": replica,
        "repair_overhead": round(repair_bytes / replica, 5) if replica else None,
        "reseeds": sum((s.get("reseed") or {}).get("count", 0) for s in r.shadow_status),
        "persist": [{k: (s.get("persist") or {}).get(k) for k in
                     ("written", "errors", "last_error", "alive", "last_iteration")}
                    for s in r.shadow_status if s.get("persist")],
        "shadow_drops": [s.get("drops", {}) for s in r.shadow_status],
        "shadow_receivers": [s.get("receiver", {}) for s in r.shadow_status],
    }
