"""``checkmate doctor``'s checks of this machine's software: versions, the optimizer against
the shadows' kernels, the job secret, the kernels in Numba's cache, the NCCL plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkmate.errors import CheckmateError
from checkmate.launch.doctor import FAIL, PASS, WARN, Check

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "build" / "nccl" / "libnccl-net-ckm.so"
#: The distribution whose requirements name the versions the project is built against.
DIST = "checkmate-ckpt"
#: The oldest CUDA a torch build of ours may use (torch 2.13 ships 12.x and 13.x builds).
MIN_CUDA = (12, 0)
#: Parameters and steps of the optimizer check: big enough for every kernel form, seconds.
OPTIM_PARAMS, OPTIM_STEPS = 1_000_000, 3
#: The symbols NCCL looks up in a net plugin (docs/nccl_plugin.md).
NET_SYMBOLS = ("ncclNetPlugin_v10", "ncclNetPlugin_v11", "ncclNetPlugin_v12")


def _requirement(name: str) -> str | None:
    """The version specifier the installed project requires of package ``name``."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        reqs = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return None
    for text in reqs:
        r = Requirement(text)
        if r.name == name and r.marker is None:
            return str(r.specifier)
    return None


def check_versions(required: dict[str, str | None] | None = None) -> list[Check]:
    """torch and numba against the project's requirements (or ``required``: package ->
    specifier); CUDA's version and devices."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    required = required or {pkg: _requirement(pkg) for pkg in ("torch", "numba")}
    out = []
    for pkg, spec in required.items():
        try:
            have = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out.append(Check(FAIL, pkg, f"not installed: pip install '{pkg}{spec or ''}'"))
            continue
        if spec is None:
            out.append(Check(WARN, pkg, f"{have}; the project ({DIST}) is not installed, "
                             "so no required range is known: pip install -e ."))
        elif SpecifierSet(spec).contains(have, prereleases=True):
            out.append(Check(PASS, pkg, f"{have} (required {spec})"))
        else:
            out.append(Check(FAIL, pkg, f"{have}, the project requires {spec}: "
                             f"pip install '{pkg}{spec}'"))
    out.append(check_cuda())
    return out


def check_cuda() -> Check:
    import torch

    built = torch.version.cuda
    if built is None:
        return Check(WARN, "CUDA", f"torch {torch.__version__} is a CPU build: the job runs "
                     "on CPU (install a CUDA build of torch for GPUs)")
    major, minor = (int(x) for x in built.split(".")[:2])
    if (major, minor) < MIN_CUDA:
        return Check(FAIL, "CUDA", f"torch is built for CUDA {built}, older than "
                     f"{'.'.join(map(str, MIN_CUDA))}: install a newer torch build")
    if not torch.cuda.is_available():
        return Check(WARN, "CUDA", f"torch is built for CUDA {built} but sees no device "
                     "(driver, CUDA_VISIBLE_DEVICES?): the job would run on CPU")
    return Check(PASS, "CUDA", f"{built}, {torch.cuda.device_count()} device(s), "
                 f"{torch.cuda.get_device_name(0)}")


def check_optimizer(device: str) -> Check:
    """checkmate.optim.AdamW on ``device`` against the shadows' Numba kernels, bit for bit
    (the device check's comparison, checkmate.optim.device_check, kept to this one call)."""
    from checkmate.optim import device_check

    case = next(c for c in device_check.CASES if c.name == "adamw")
    name = f"optimizer on {device}"
    try:
        r = device_check.check_case(case, n=OPTIM_PARAMS, steps=OPTIM_STEPS, device=device)
    except Exception as e:  # noqa: BLE001 - any failure of the device is this check's FAIL
        return Check(FAIL, name, f"AdamW could not run: {type(e).__name__}: "
                     f"{' '.join(str(e).split())[:200]}")
    if r.ok:
        return Check(PASS, name, f"AdamW matches the shadow kernels: {r.detail}")
    return Check(FAIL, name, f"AdamW differs from the shadow kernels ({r.detail}): the "
                 "shadows would drift from the trainers; report it with this line")


def check_secret(path: str | None = None) -> Check:
    """The job secret ($CHECKMATE_SECRET_FILE) exists, is readable, valid and mode 0600."""
    from checkmate.protocol import auth

    where = path or os.environ.get(auth.SECRET_ENV)
    if not where:
        return Check(WARN, "job secret", f"{auth.SECRET_ENV} is not set: fine for "
                     "`checkmate launch --shadows n` (it makes one); shadows of your own "
                     f"need it: `checkmate secret new FILE`, then {auth.SECRET_ENV}=FILE")
    try:
        auth.load_secret(where)
    except CheckmateError as e:
        return Check(FAIL, "job secret", str(e))
    return Check(PASS, "job secret", f"{where} readable, mode 600")


#: Runs in a fresh interpreter: warm the shadow kernels as a shadow does at start and count
#: Numba's cache hits and misses over every compiled dispatcher of checkmate.
_KERNEL_PROBE = """
import json, sys, time
t = time.perf_counter()
from checkmate.shadow import ingest, kernels
ingest.warm(); kernels.warm_up_kernels()
from numba.core.dispatcher import Dispatcher
hits = misses = 0
path = None
for name, mod in list(sys.modules.items()):
    if name.startswith("checkmate"):
        for v in list(vars(mod).values()):
            if isinstance(v, Dispatcher):
                s = v.stats
                hits += sum(s.cache_hits.values()); misses += sum(s.cache_misses.values())
                path = path or s.cache_path
print(json.dumps({"hits": hits, "misses": misses, "path": path,
                  "seconds": time.perf_counter() - t}))
"""


def _probe_kernels(env: dict[str, str] | None) -> dict:
    p = subprocess.run([sys.executable, "-c", _KERNEL_PROBE], capture_output=True, text=True,
                       env=env, timeout=600)
    if p.returncode:
        lines = (p.stderr or p.stdout).strip().splitlines()
        raise CheckmateError(lines[-1] if lines else f"exit code {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_kernels(env: dict[str, str] | None = None) -> Check:
    """The shadow's kernels load from Numba's on-disk cache (`make kernels` puts them
    there), so no shadow waits 10-30 s for the compiler when a job starts."""
    name = "shadow kernels"
    try:
        first = _probe_kernels(env)
        if not first["hits"] + first["misses"]:
            return Check(FAIL, name, "Numba compiled no kernel (NUMBA_DISABLE_JIT set?): a "
                         "shadow would run its kernels as plain Python, far too slowly")
        if not first["misses"]:
            return Check(PASS, name, f"{first['hits']} loaded from Numba's cache "
                         f"({first['path']}) in {first['seconds']:.1f} s")
        second = _probe_kernels(env)  # the first run compiled them: are they kept?
    except (CheckmateError, subprocess.TimeoutExpired, ValueError) as e:
        return Check(FAIL, name, f"the kernels do not build: {e}")
    if second["misses"]:
        return Check(FAIL, name, f"Numba does not keep them ({first['path']}): every shadow "
                     "compiles for 10-30 s at start; make NUMBA_CACHE_DIR a writable folder")
    return Check(WARN, name, f"{first['misses']} were not in Numba's cache: compiled now "
                 f"({first['seconds']:.0f} s) and cached for the next start; run `make "
                 "kernels` after installing")


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL release torch loads (None without CUDA)."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.nccl.version())


def check_nccl_plugin(plugin: Path = PLUGIN,
                      version: tuple[int, ...] | None = None) -> list[Check]:
    """The ckm NCCL net plugin is built, loads, exports NCCL's plugin symbols; and (with
    CUDA) whether the NCCL that torch loads is a release the plugin's schedule was checked
    against (docs/nccl_plugin.md, "Supported releases")."""
    import ctypes

    if not plugin.is_file():
        return [Check(FAIL, "NCCL plugin", f"{plugin} is not built: make nccl")]
    try:
        lib = ctypes.CDLL(str(plugin))
    except OSError as e:
        return [Check(FAIL, "NCCL plugin", f"{plugin} does not load: {e}: make nccl")]
    missing = [s for s in NET_SYMBOLS if not hasattr(lib, s)]
    if missing:
        return [Check(FAIL, "NCCL plugin", f"{plugin} lacks {', '.join(missing)}: "
                      "rebuild it (make nccl)")]
    out = [Check(PASS, "NCCL plugin", f"{plugin} loads ({', '.join(NET_SYMBOLS)})")]
    if version is None:
        version = nccl_version()
    if version is None:
        out.append(Check(WARN, "NCCL release", "skipped: no CUDA here, so no NCCL to load "
                         "the plugin (a CPU job does not use it)"))
        return out
    from checkmate.testbed import nccl_release

    code = version[0] * 10000 + version[1] * 100 + version[2]
    text = ".".join(map(str, version))
    if nccl_release.release_of(code) is None:
        ranges = ", ".join(f"{_dotted(r.lo)}-{_dotted(r.hi)}" for r in nccl_release.RELEASES)
        out.append(Check(FAIL, "NCCL release", f"torch loads NCCL {text}, not a release the "
                         f"plugin's schedule was checked against ({ranges}): the plugin "
                         "would run untagged; install a torch whose NCCL is in that range"))
    else:
        out.append(Check(PASS, "NCCL release", f"torch loads NCCL {text}: NCCL_NET_PLUGIN="
                         f"{plugin} would tag its traffic"))
    return out


def _dotted(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
