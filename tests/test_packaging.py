"""The wheel a training team installs: what it carries, and that it fits their environment.

A team installs Checkmate into the Python they already train in, with their own (often
CUDA) torch. The wheel built from this tree must carry the sources it needs at run time and
none of tests/, declare torch as a range, and install with ``--no-deps`` over an existing
torch without touching it; ``import checkmate.train, checkmate.optim`` must then work with
only the core dependencies present. No network: the fresh venv sees this environment's core
packages (and only those) through a ``.pth`` file.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CORE = {"torch", "numpy", "numba", "pyyaml", "crc32c", "pydantic"}
#: Optional packages no trainer may need: each is absent from the fresh venv.
NOT_CORE = ("prometheus_client", "grpc", "google.protobuf", "pyroute2", "rich", "matplotlib",
            "p4", "scapy", "hypothesis")

pytestmark = pytest.mark.slow


def _offline_env() -> dict[str, str]:
    """pip with no index, no find-links and no config: nothing can be downloaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built from a copy (build/ here may be a shared folder)."""
    src = tmp_path_factory.mktemp("src")
    files = _run("git", "ls-files", "-co", "--exclude-standard", cwd=ROOT).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, src, env=_offline_env())
    (whl,) = out.glob("checkmate_ckpt-*.whl")
    return whl


def _metadata(whl: Path):
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def test_the_wheel_carries_the_run_time_sources_and_no_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("checkmate/train/session.py", "checkmate/optim/__init__.py",
                 "checkmate/extras.py", "checkmate/dataplane/bpf/ckm_switch.c",
                 "checkmate/dataplane/bpf/ckm_wire.h", "checkmate/p4/checkmate_v1model.p4",
                 "checkmate/p4/checkmate_tna.p4", "checkmate/p4/include/ckm_headers.p4",
                 "checkmate/nccl_plugin/Makefile", "checkmate/nccl_plugin/ckm_net.c",
                 "checkmate/nccl_plugin/ckm_wire.h", "checkmate/testbed/default.yaml"):
        assert need in names, f"{need} is not in {wheel.name}"
    src_plugin = {p.relative_to(ROOT).as_posix() for p in (ROOT / "nccl_plugin").rglob("*")
                  if p.is_file() and p.suffix in (".c", ".h")}
    missing = {s for s in src_plugin if f"checkmate/{s}" not in names}
    assert not missing, f"NCCL plugin sources missing from the wheel: {sorted(missing)}"
    stray = sorted(n for n in names if n.startswith(("tests/", "checkmate/tests/", "build/"))
                   or "/tests/" in n or "__pycache__" in n)
    assert not stray, f"the wheel carries {stray[:5]}"


def test_the_wheel_declares_a_torch_range_and_only_the_core_for_a_trainer(wheel):
    meta = _metadata(wheel)
    assert meta["Requires-Python"] == ">=3.11"
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    core = {canonicalize_name(r.name): r for r in reqs if r.marker is None}
    assert set(core) == CORE, f"core dependencies {sorted(core)}"
    torch = core["torch"]
    assert not any(s.operator in ("==", "===", "~=") for s in torch.specifier), torch
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.15.0"), torch
    assert not torch.specifier.contains("2.10.0"), "the lowest torch declared is the lowest checked"
    extras = set(meta.get_all("Provides-Extra"))
    assert {"metrics", "shadow", "switch", "testbed", "bench", "test"} <= extras, extras
    switch = {canonicalize_name(r.name) for r in reqs
              if r.marker is not None and r.marker.evaluate({"extra": "switch"})}
    assert {"p4runtime", "grpcio", "protobuf", "pyroute2"} <= switch, switch


def _closure(roots: set[str]) -> set[str]:
    """Distribution names of ``roots`` and everything they require here (no extras)."""
    seen: set[str] = set()
    todo = list(roots)
    env = default_environment()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for raw in md.distribution(name).requires or []:
            r = Requirement(raw)
            if r.marker is None or r.marker.evaluate({**env, "extra": ""}):
                todo.append(r.name)
    return seen


def _core_site(dest: Path, extra: tuple[str, ...] = ()) -> None:
    """``dest``: links to the installed files of the core packages' closure, nothing else."""
    dest.mkdir()
    for name in _closure(CORE | set(extra)):
        dist = md.distribution(name)
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            target, link = Path(dist.locate_file(top)), dest / top
            if target.exists() and not link.exists():
                link.symlink_to(target)


def _core_venv(where: Path, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A fresh venv that sees the core packages (and ``extra`` ones) of this environment
    through a .pth file, as a team's training environment already has them: (python, site)."""
    site = where / "core-site"
    _core_site(site, extra)
    venv = where / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                   .stdout.strip())
    (purelib / "core-site.pth").write_text(f"{site}\n")
    return py, purelib


def test_installing_over_an_existing_torch_leaves_it_and_imports_with_the_core(wheel, tmp_path):
    py, purelib = _core_venv(tmp_path)
    probe = ("import importlib.metadata as md, torch; "
             "print(torch.__version__, torch.__file__, md.version('torch'))")
    before = _run(py, "-c", probe).stdout
    env = _offline_env()
    # pip's resolver, offline, finds every dependency already there (torch included), so a
    # plain install would add the project alone
    dry = _run(sys.executable, "-m", "pip", "--python", py, "install", "--dry-run", wheel,
               env=env).stdout
    would = [ln for ln in dry.splitlines() if ln.startswith("Would install")]
    assert would == ["Would install checkmate-ckpt-0.1.0"], dry
    _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel,
         env=env)
    assert _run(py, "-c", probe).stdout == before, "installing the wheel changed torch"
    assert not list(purelib.glob("torch*")), "a torch was installed into the venv"

    check = f"""
import importlib.util, sys
import checkmate.train, checkmate.optim
import checkmate.train.session, checkmate.train.ddp, checkmate.launch.cli
assert checkmate.__file__.startswith({str(purelib)!r}), checkmate.__file__
absent = [m for m in {NOT_CORE!r} if importlib.util.find_spec(m.split(".")[0]) is not None]
assert not absent, f"not core, but importable: {{absent}}"
print("ok")
"""
    assert _run(py, "-c", check, cwd=tmp_path).stdout.strip() == "ok"
    # a role's module without its extra names the extra in one line
    for module, extra in (("checkmate.control.p4rt_client", "switch"),
                          ("checkmate.metrics", "metrics")):
        r = subprocess.run([py, "-c", f"import {module}"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=120)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert f"pip install 'checkmate-ckpt[{extra}]'" in last, r.stderr


def test_device_check_script_installs_the_wheel_into_the_given_python(wheel, tmp_path):
    """scripts/device-check.sh on a Python that does not import the project (as the GPU
    machine's): it installs the wheel with that Python's pip and runs the check from it."""
    py, purelib = _core_venv(tmp_path, ("pip",))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy2(wheel, wheels)
    env = {**_offline_env(), "PYTHON": str(py), "DEVICE_WHEELS": str(wheels),
           "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run(["bash", ROOT / "scripts/device-check.sh", "--cpu-smoke", "--only",
                        "optim", "--cpu-n", "3001", "--cpu-steps", "3", "--budget", "300"],
                       capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "device-check summary:" in out and " 0 failed" in out, out[-3000:]
    assert "PASS" in out, out[-3000:]
    # installed into that Python, not onto a path of the script's; its torch left alone
    where = _run(py, "-c", "import checkmate; print(checkmate.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(purelib)), where
    assert not list(purelib.glob("torch*")), "the check installed a torch"
