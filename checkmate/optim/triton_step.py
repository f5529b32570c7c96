"""The update rule as Triton kernels, generated from :mod:`checkmate.optim.rule`.

The kernel body is not written by hand: :func:`checkmate.optim.rule.trace_adam` /
``trace_sgd`` record the rule's operations and :func:`kernel_source` prints one Triton
statement per operation, each exact in float32:

- ``mul``/``add``/``sub``: ``*``, ``+``, ``-`` on float32 (IEEE round to nearest), with
  FP fusion disabled at launch (``enable_fp_fusion=False``: LLVM may not contract and
  ptxas runs with ``--fmad=false``), so no multiply and add become one FMA;
- ``div``: ``tl.div_rn`` and ``sqrt``: ``tl.sqrt_rn`` (Triton's ``/`` and ``tl.sqrt`` are
  approximate on float32);
- ``fma``: ``tl.fma`` (one rounding);
- ``maximum``: ``tl.where((a > b) | (a != a), a, b)``.

Libdevice's flush-to-zero is switched off at launch where this Triton has the option
(``enable_reflect_ftz=False``), so subnormals are kept as IEEE float32 keeps them. Scalars
are loaded once per program and splat over the block (``tl.fma`` and ``tl.div_rn`` do not
broadcast).

Three forms share the body: a *direct* kernel (one tensor per launch, pointer arguments
that Triton knows to be aligned; for huge tensors), an aligned *table16* kernel (many
tensors in one launch: an int64 table of their 16-byte aligned addresses, sizes multiples
of 16, one program per block, alignment hints so loads are 128-bit) and a plain *table*
kernel (tails and misaligned tensors). Each is one pass over memory. triton is imported
only when a kernel is first needed; generated modules are written to a cache directory so
Triton can read their source.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from types import ModuleType
from typing import Any

import numpy as np
import torch

from checkmate.errors import CheckmateError
from checkmate.optim import rule

#: elements per program.
BLOCK = 1024
#: warps per program.
NUM_WARPS = 4
#: tensors at least this large get a launch of their own (direct kernel). The aligned table
#: kernel is as fast per element (a program's table lookups are a few cached loads against
#: 28 KiB of Adam traffic) and steps a whole group in one launch, with fewer kernels to
#: compile; the direct form is for tensors whose block table alone would be large.
DIRECT_MIN = 1 << 28

#: kernel forms: one tensor per launch; a table of tensors whose pointers are 16-byte
#: aligned and sizes multiples of 16 (hinted, so loads are vectorized); any table.
FORMS = ("direct", "table16", "table")
#: a table16 row's element count is a multiple of this, and its pointers of 16 bytes.
ALIGN = 16

#: one Triton expression per rule operation.
EMIT = {
    "mul": "{0} * {1}",
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "div": "tl.div_rn({0}, {1})",
    "sqrt": "tl.sqrt_rn({0})",
    "fma": "tl.fma({0}, {1}, {2})",
    "maximum": "tl.where(({0} > {1}) | ({0} != {0}), {0}, {1})",
}

GRAD_TL = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16",
           torch.float16: "tl.float16"}

#: kernel slots (tensor arguments / table columns) per kind, in table order.
ADAM_SLOTS = ("p", "g", "m", "v", "vmax")
SGD_SLOTS = ("p", "g", "buf")


def _trace(flags: rule.AdamFlags | rule.SgdFlags) -> tuple[rule.Tracer, dict[str, str], tuple,
                                                          tuple[str, ...]]:
    """(tracer, {slot: output value}, scalar names, slots) of a rule variant."""
    if isinstance(flags, rule.AdamFlags):
        t, (p, m, v, vmax) = rule.trace_adam(flags)
        outs = {"p": p, "m": m, "v": v, "vmax": vmax}
        return t, outs, rule.ADAM_SCALARS, ADAM_SLOTS
    t, (p, buf) = rule.trace_sgd(flags)
    return t, {"p": p, "buf": buf}, rule.SGD_SCALARS, SGD_SLOTS


def kernel_name(flags: rule.AdamFlags | rule.SgdFlags, grad_dtype: torch.dtype,
                form: str) -> str:
    return f"{flags.tag}_{str(grad_dtype).removeprefix('torch.')}_{form}"


def _layout(flags: rule.AdamFlags | rule.SgdFlags) -> dict[str, Any]:
    """What a kernel of this rule variant reads, writes and takes as pointers."""
    tracer, outs, scalar_names, slots = _trace(flags)
    used = {a for _, _, args in tracer.ops for a in args}
    inputs = [s for s in slots if s in used or s == "g"]  # g is always read
    stored = [s for s in slots if s in outs and outs[s] != s]
    return {"tracer": tracer, "outs": outs, "slots": slots, "scalar_names": scalar_names,
            "inputs": inputs, "stored": stored,
            "ptr_slots": [s for s in slots if s in inputs or s in stored],
            "scalars": [(i, n) for i, n in enumerate(scalar_names) if n in used]}


def kernel_source(flags: rule.AdamFlags | rule.SgdFlags, grad_dtype: torch.dtype,
                  form: str) -> str:
    """Python source of one Triton kernel (``form``: ``"direct"`` or ``"table"``)."""
    if grad_dtype not in GRAD_TL:
        raise CheckmateError(f"no Triton kernel for {grad_dtype} gradients")
    if form not in FORMS:
        raise CheckmateError(f"unknown kernel form {form!r}")
    lay = _layout(flags)
    tracer, outs, slots = lay["tracer"], lay["outs"], lay["slots"]
    inputs, stored, ptr_slots, scalars = (lay["inputs"], lay["stored"], lay["ptr_slots"],
                                          lay["scalars"])
    scalar_names = lay["scalar_names"]
    name = kernel_name(flags, grad_dtype, form)
    lines = ["import triton", "import triton.language as tl", "", "",
             "# Generated by checkmate.optim.triton_step from checkmate.optim.rule; do not edit.",
             "@triton.jit"]
    ns = len(scalar_names)
    if form == "direct":
        args = [f"{s}_ptr" for s in ptr_slots] + ["sc", "n", "BLOCK: tl.constexpr"]
        lines.append(f"def {name}({', '.join(args)}):")
        lines += ["    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
                  "    mask = offs < n"]
    else:
        # table16: the host guarantees the hints (launch() checks every pointer)
        hint = (lambda x, k: f"tl.multiple_of({x}, {k})") if form == "table16" else (
            lambda x, k: x)
        lines.append(f"def {name}(ptrs, scal, blk_t, blk_lo, lens, BLOCK: tl.constexpr):")
        lines += ["    pid = tl.program_id(0)",
                  "    t = tl.load(blk_t + pid).to(tl.int64)",
                  f"    offs = {hint('tl.load(blk_lo + pid)', 'BLOCK')} + tl.arange(0, BLOCK)",
                  f"    mask = offs < {hint('tl.load(lens + t)', ALIGN)}",
                  f"    sc = scal + t * {ns}"]
        for s in ptr_slots:
            ty = GRAD_TL[grad_dtype] if s == "g" else "tl.float32"
            ptr = (f"tl.load(ptrs + t * {len(slots)} + {slots.index(s)})"
                   f".to(tl.pointer_type({ty}))")
            lines.append(f"    {s}_ptr = {hint(ptr, ALIGN)}")
    for i, n in scalars:  # one load per program, splat: tl.fma / tl.div_rn need equal shapes
        lines.append(f"    {n} = tl.full([BLOCK], tl.load(sc + {i}), tl.float32)")
    for s in inputs:
        conv = ".to(tl.float32)" if s == "g" and grad_dtype != torch.float32 else ""
        lines.append(f"    {s} = tl.load({s}_ptr + offs, mask=mask, other=0.0){conv}")
    for out, op, args in tracer.ops:
        lines.append(f"    {out} = {EMIT[op].format(*args)}  # rule: {op}({', '.join(args)})")
    for s in stored:
        lines.append(f"    tl.store({s}_ptr + offs, {outs[s]}, mask=mask)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- runtime


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton() -> ModuleType | None:
    try:
        import triton
    except ImportError:
        return None
    return triton


def available(device: torch.device) -> bool:
    """Whether the Triton path can step tensors on ``device``."""
    if _triton() is None:
        return False
    if interpreting():
        return device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available()


@functools.cache
def launch_options() -> dict[str, Any]:
    """Compiler options every launch passes: no FP contraction, no libdevice FTZ."""
    opts: dict[str, Any] = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
    if interpreting():
        return opts
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
            opts["enable_reflect_ftz"] = False
    except ImportError:
        pass
    return opts


def _cache_dir() -> str:
    d = os.environ.get("CHECKMATE_TRITON_DIR") or os.path.join(
        tempfile.gettempdir(), f"checkmate-triton-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    return d


@functools.cache
def _kernel(flags: rule.AdamFlags | rule.SgdFlags, grad_dtype: torch.dtype, form: str,
            interp: bool) -> Any:
    """The compiled-on-first-launch Triton function (``interp`` keys the cache only)."""
    if _triton() is None:
        raise CheckmateError("triton is not installed: the Triton optimizer path is unavailable")
    src = kernel_source(flags, grad_dtype, form)
    name = kernel_name(flags, grad_dtype, form)
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"ckm_{name}_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    modname = f"checkmate_triton_{name}_{digest}_{int(interp)}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def ptx(flags: rule.AdamFlags | rule.SgdFlags, grad_dtype: torch.dtype, form: str,
        arch: int = 90) -> str:
    """The PTX Triton makes of a kernel for ``sm_<arch>`` with the launch options, as a
    launch with 16-byte aligned tensors and a size divisible by 16 would specialize it.
    Needs triton but no GPU (tests read it: every float op ``.rn``, no ``.ftz``)."""
    triton = _triton()
    if triton is None:
        raise CheckmateError("triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lay = _layout(flags)
    elem = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
    if form == "direct":
        sig = {f"{s}_ptr": elem[grad_dtype] if s == "g" else "*fp32" for s in lay["ptr_slots"]}
        aligned = list(range(len(sig))) + [len(sig) + 1]  # the pointers and n
        sig.update({"sc": "*fp32", "n": "i64"})
    else:
        sig = {"ptrs": "*i64", "scal": "*fp32", "blk_t": "*i32", "blk_lo": "*i64",
               "lens": "*i64"}
        aligned = list(range(len(sig)))
    sig["BLOCK"] = "constexpr"
    src = ASTSource(fn=_kernel(flags, grad_dtype, form, False), signature=sig,
                    constexprs={"BLOCK": BLOCK},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    opts = {k: v for k, v in launch_options().items()}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts).asm["ptx"]


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host table on ``device`` without making the host wait for the device."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.clone()


_BLOCK_MAPS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _block_map(lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(blk_t, blk_lo, lens) device tables of a table launch, cached by the sizes."""
    key = (lens, str(device))
    got = _BLOCK_MAPS.get(key)
    if got is None:
        n = np.array(lens, np.int64)
        counts = (n + BLOCK - 1) // BLOCK
        first = np.repeat(np.cumsum(counts) - counts, counts)
        blk_t = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
        blk_lo = (np.arange(int(counts.sum()), dtype=np.int64) - first) * BLOCK
        got = (_to_device(blk_t, device), _to_device(blk_lo, device), _to_device(n, device))
        if len(_BLOCK_MAPS) > 64:
            _BLOCK_MAPS.clear()
        _BLOCK_MAPS[key] = got
    return got


def launch(flags: rule.AdamFlags | rule.SgdFlags, rows: list[dict[str, torch.Tensor]],
           scal: np.ndarray) -> None:
    """Step every row (slot name -> flat tensor; one device, one gradient dtype) with the
    rule variant ``flags``; ``scal[i]`` are row i's kernel scalars (ops.*_scalars)."""
    if not rows:
        return
    device = rows[0]["p"].device
    grad_dtype = rows[0]["g"].dtype
    interp = interpreting()
    opts = launch_options()
    lay = _layout(flags)
    slots, ptr_slots = lay["slots"], lay["ptr_slots"]
    scal = np.asarray(scal, np.float32).reshape(len(rows), -1)
    # Each tensor: its largest multiple of ALIGN elements goes to a hinted kernel (direct
    # when large) if every pointer is 16-byte aligned; the rest (a tail of < ALIGN
    # elements, or the whole of a misaligned tensor) to the plain table kernel. Table rows
    # are addresses: (address per slot, elements, row of scal).
    direct: list[tuple[dict[str, torch.Tensor], int, int]] = []
    tables: dict[str, list[tuple[list[int], int, int]]] = {"table16": [], "table": []}
    for i, r in enumerate(rows):
        n = r["p"].numel()
        addr = [r[s].data_ptr() if s in ptr_slots else 0 for s in slots]
        bulk = 0 if any(a % 16 for a in addr) else n - n % ALIGN
        if bulk >= DIRECT_MIN:
            direct.append((r, bulk, i))
        elif bulk:
            tables["table16"].append((addr, bulk, i))
        if bulk < n:
            tail = [a + bulk * r[s].element_size() if a else 0
                    for a, s in zip(addr, slots, strict=True)]
            tables["table"].append((tail, n - bulk, i))
    if direct:
        k = _kernel(flags, grad_dtype, "direct", interp)
        scal_dev = _to_device(scal[[i for _, _, i in direct]], device)
        for j, (r, n, _) in enumerate(direct):
            k[(triton_cdiv(n, BLOCK),)](*[r[s] for s in ptr_slots], scal_dev[j], n,
                                        BLOCK=BLOCK, **opts)
    for form, items in tables.items():
        if not items:
            continue
        table = np.array([a for a, _, _ in items], np.int64)
        blk_t, blk_lo, lens = _block_map(tuple(n for _, n, _ in items), device)
        k = _kernel(flags, grad_dtype, form, interp)
        k[(blk_t.numel(),)](_to_device(table, device),
                            _to_device(scal[[i for _, _, i in items]], device), blk_t,
                            blk_lo, lens, BLOCK=BLOCK, **opts)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
