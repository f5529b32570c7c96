"""A soft-RoCE guest: QEMU (TCG) booting Debian's own kernel, for what needs RDMA here.

This machine's kernel has no InfiniBand and cannot load modules, so the verbs receiver
(checkmate.shadow.verbs) is verified inside a guest that can: ``build()`` takes the
kernel package (linux-image-amd64 and the image it depends on) and busybox-static from
Debian, computes the module order with depmod, and packs a small initramfs whose init
loads virtio, 9p and rdma_rxe (with ib_core, ib_uverbs, crc32, the UDP tunnels), mounts
this machine's root read-only over virtio-9p, gives the guest a virtio NIC, creates
``rxe0`` on it and runs one command in a chroot of that root: the project, its venv and
Debian's python3-pyverbs are then the same files as here. A writable 9p share (the run
folder) holds the command, the job secret, the Numba cache and what the command writes.

    python -m checkmate.testbed.guest build          # into build/guest (or $CHECKMATE_GUEST)
    python -m checkmate.testbed.guest run -- CMD...  # boot, run CMD in the project root

KVM is not used: a nested KVM boot hangs on this machine; TCG is slow (Python runs about
10-20x slower than here) but real. The QEMU process is stopped by its PID.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkmate.errors import CheckmateError

ROOT = Path(__file__).resolve().parents[1]
#: Debian packages the guest needs on this machine (the kernel's comes by apt-get download).
PACKAGES = ("qemu-system-x86", "busybox-static", "kmod", "cpio", "rdma-core",
            "ibverbs-providers", "python3-pyverbs", "iproute2")
#: Kernel modules loaded in the guest, in this order (each after what it depends on;
#: build() checks that against modules.dep).
MODULES = ("virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
           "virtio_pci", "failover", "net_failover", "virtio_net", "netfs", "fscache",
           "9pnet", "9pnet_virtio", "9p", "crc32_generic", "ib_core", "ib_uverbs",
           "udp_tunnel", "ip6_udp_tunnel", "rdma_rxe")
_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in {modules}; do insmod /mods/$m.ko || echo "ckm-guest: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro hostroot /host || echo "ckm-guest: no host root"
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev; mount -t tmpfs tmpfs /host/run
mkdir -p /host/run/ckm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /host/run/ckm
mkdir -p /host/dev/shm 2>/dev/null; mount -t tmpfs tmpfs /host/dev/shm
ip link set lo up; ip link set eth0 up; ip addr add 10.99.0.2/24 dev eth0
chroot /host /bin/sh /run/ckm/boot.sh
poweroff -f
"""


#: Where the run share appears in the guest: under the guest's own tmpfs /run, so that it
#: hides none of this machine's files (a project under /tmp stays visible).
SHARE = "/run/ckm"


def _stamp() -> str:
    """What the initramfs is made from: a changed init or module list rebuilds it."""
    import hashlib

    return hashlib.sha256((_INIT + " ".join(MODULES)).encode()).hexdigest()[:16]


def guest_dir() -> Path:
    return Path(os.environ.get("CHECKMATE_GUEST", ROOT / "build" / "guest"))


def missing_tools() -> list[str]:
    """What this machine lacks to build or boot the guest (empty: nothing)."""
    need = {"qemu-system-x86_64": "qemu-system-x86", "busybox": "busybox-static",
            "depmod": "kmod", "cpio": "cpio", "dpkg": "dpkg", "apt-get": "apt"}
    out = [f"{tool} ({pkg})" for tool, pkg in need.items() if shutil.which(tool) is None]
    if not Path("/usr/lib/python3/dist-packages/pyverbs").is_dir():
        out.append("pyverbs (python3-pyverbs)")
    if not glob.glob("/usr/lib/x86_64-linux-gnu/libibverbs/librxe*"):
        out.append("the rxe provider (ibverbs-providers)")
    return out


def unavailable() -> str | None:
    """Why the guest cannot boot here, or None when it can."""
    miss = missing_tools()
    if miss:
        return "not installed: " + ", ".join(miss) + " (sudo make setup installs them)"
    d = guest_dir()
    stamp = d / "initrd.stamp"
    if not (d / "vmlinuz").is_file() or not stamp.is_file() \
            or stamp.read_text().strip() != _stamp():
        return f"no current guest built in {d} (python -m checkmate.testbed.guest build)"
    return None


def _busybox() -> str:
    path = shutil.which("busybox") or ""
    info = subprocess.run(["file", "-L", path], capture_output=True, text=True).stdout \
        if shutil.which("file") else ""
    if "dynamically linked" in info:
        raise CheckmateError(f"{path} is dynamically linked: install busybox-static")
    return path


def build(force: bool = False) -> Path:
    """Kernel and initramfs under guest_dir(); nothing is done when both exist."""
    d = guest_dir()
    stamp = d / "initrd.stamp"
    if not force and (d / "vmlinuz").is_file() and (d / "initrd.gz").is_file() \
            and stamp.is_file() and stamp.read_text().strip() == _stamp():
        return d
    miss = missing_tools()
    if miss:
        raise CheckmateError("cannot build the guest, missing: " + ", ".join(miss))
    d.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckm-guest-build-", dir=d))
    try:
        meta = subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                              capture_output=True, text=True, check=True).stdout
        m = re.search(r"Depends: (linux-image-[0-9][^\s]*-amd64)", meta)
        if m is None:
            raise CheckmateError("apt-cache knows no linux-image-amd64 kernel image package")
        pkg = m.group(1)
        subprocess.run(["apt-get", "download", pkg], cwd=work, check=True,
                       capture_output=True)
        deb = next(work.glob(f"{pkg}_*.deb"))
        tree = work / "tree"
        subprocess.run(["dpkg", "-x", str(deb), str(tree)], check=True)
        release = pkg.removeprefix("linux-image-")
        subprocess.run(["depmod", "-b", str(tree), release], check=True)
        mods = tree / "lib" / "modules" / release
        deps = _modules_dep(mods / "modules.dep")
        initrd = work / "initrd"
        for sub in ("bin", "proc", "sys", "dev", "host", "mods"):
            (initrd / sub).mkdir(parents=True)
        shutil.copy(_busybox(), initrd / "bin" / "busybox")
        loaded: set[str] = set()
        for name in MODULES:
            path, needs = deps[name]
            missing = [n for n in needs if n not in loaded]
            if missing:
                raise CheckmateError(f"guest module order: {name} needs {missing} first")
            shutil.copy(mods / path, initrd / "mods" / f"{name}.ko")
            loaded.add(name)
        (initrd / "init").write_text(_INIT.format(modules=" ".join(MODULES)))
        (initrd / "init").chmod(0o755)
        files = subprocess.run(["find", "."], cwd=initrd, capture_output=True, check=True).stdout
        cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=initrd, input=files,
                              capture_output=True, check=True).stdout
        import gzip

        (d / "initrd.gz").write_bytes(gzip.compress(cpio, 1))
        shutil.copy(tree / "boot" / f"vmlinuz-{release}", d / "vmlinuz")
        (d / "kernel-release").write_text(release + "\n")
        stamp.write_text(_stamp() + "\n")
    except subprocess.CalledProcessError as e:
        raise CheckmateError(f"guest build step failed: {' '.join(map(str, e.cmd))}: "
                             f"{(e.stderr or b'').decode(errors='replace').strip()[-300:]}"
                             ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return d


def _modules_dep(path: Path) -> dict[str, tuple[str, list[str]]]:
    """module name -> (its path, the names it depends on) from depmod's modules.dep."""
    out: dict[str, tuple[str, list[str]]] = {}
    for line in path.read_text().splitlines():
        mod, _, rest = line.partition(":")
        name = Path(mod).name.split(".ko")[0].replace("-", "_")
        out[name] = (mod, [Path(r).name.split(".ko")[0].replace("-", "_")
                           for r in rest.split()])
    return out


def warm_numba(share: Path) -> str | None:
    """Compile the checks' Numba code here, natively, into the guest's cache (see
    checkmate.testbed.guest_warm: under TCG that compile takes minutes); None when done,
    else why not (the guest then compiles for itself, slowly)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(share / "numba-cache"),
           "NUMBA_CPU_NAME": "generic", "CHECKMATE_SECRET_FILE": str(share / "secret.key")}
    env.pop("NUMBA_CPU_FEATURES", None)
    try:
        r = subprocess.run([sys.executable, "-m", "checkmate.testbed.guest_warm"], env=env,
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "the warm-up took over 600 s"
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return lines[-1] if lines else f"the warm-up exited {r.returncode}"
    return None


def run(command: str, timeout: float = 900.0, env: dict[str, str] | None = None,
        memory_mb: int = 3072, warm: bool = True) -> tuple[int, str, Path]:
    """Boot the guest, run ``command`` (sh, in the project root) with ``env``; returns its
    exit status, its output and the share folder (where it wrote its files: /run/ckm in
    the guest, also $CKM_SHARE there). The share is build/guest/share: the Numba cache
    there outlives runs. With ``warm`` the checks' Numba code is compiled here first
    (warm_numba); guest and warm-up both target the generic CPU so the guest loads it."""
    why = unavailable()
    if why is not None:
        raise CheckmateError(f"the soft-RoCE guest cannot boot: {why}")
    import fcntl

    share = guest_dir() / "share"
    share.mkdir(exist_ok=True)
    # One run at a time per checkout (they share the folder): a second one waits its turn.
    with open(share / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("guest: another run of this checkout's guest is on; waiting", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_locked(share, command, timeout, env, memory_mb, warm)


def _run_locked(share: Path, command: str, timeout: float, env: dict[str, str] | None,
                memory_mb: int, warm: bool) -> tuple[int, str, Path]:
    d = share.parent
    for f in ("rc", "out.log", "rdma-link", "cmd.sh", "boot.sh"):
        (share / f).unlink(missing_ok=True)
    pylib = share / "pylib"
    pylib.mkdir(exist_ok=True)
    link = pylib / "pyverbs"
    if not link.is_symlink():
        link.symlink_to("/usr/lib/python3/dist-packages/pyverbs")
    from checkmate.protocol import auth

    key = share / "secret.key"
    if not key.exists():
        auth.create_secret(key)
    if warm:
        why_not = warm_numba(share)
        if why_not is not None:
            print(f"guest: Numba warm-up skipped ({why_not}); the guest compiles, slowly",
                  file=sys.stderr)
    (share / "tmp").mkdir(exist_ok=True)
    base = {"HOME": SHARE, "TMPDIR": f"{SHARE}/tmp", "CKM_SHARE": SHARE,
            "NUMBA_CACHE_DIR": f"{SHARE}/numba-cache", "NUMBA_CPU_NAME": "generic",
            "PYTHONPATH": f"{SHARE}/pylib", "PYTHONDONTWRITEBYTECODE": "1",
            "CHECKMATE_SECRET_FILE": f"{SHARE}/secret.key", "PYTHONUNBUFFERED": "1"}
    lines = [f"export {k}='{v}'" for k, v in {**base, **(env or {})}.items()]
    (share / "cmd.sh").write_text("\n".join([*lines, command, ""]))
    (share / "boot.sh").write_text(
        f"rdma link add rxe0 type rxe netdev eth0 && rdma link > {SHARE}/rdma-link || exit 1\n"
        f"cd {ROOT} && sh {SHARE}/cmd.sh > {SHARE}/out.log 2>&1\n"
        f"echo $? > {SHARE}/rc\n")
    argv = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", str(memory_mb),
            "-smp", "2", "-nographic", "-no-reboot", "-kernel", str(d / "vmlinuz"),
            "-initrd", str(d / "initrd.gz"), "-append", "console=ttyS0 quiet panic=-1",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                       "multidevs=remap",
            "-virtfs", f"local,path={share},mount_tag=share,security_model=none",
            "-netdev", "user,id=n0,restrict=on", "-device", "virtio-net-pci,netdev=n0"]
    console = share / "console.log"
    with open(console, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # ours, by PID
        proc.wait()
        raise CheckmateError(f"the guest did not finish within {timeout:.0f} s "
                             f"(console: {console})") from None
    out = (share / "out.log").read_text(errors="replace") if (share / "out.log").exists() \
        else ""
    if not (share / "rc").exists():
        tail = console.read_text(errors="replace")[-2000:]
        raise CheckmateError(f"the guest ran nothing (rxe0 not created?); console: {tail!r}")
    return int((share / "rc").read_text().strip() or 1), out, share


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkmate.testbed.guest")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="kernel + initramfs under build/guest")
    b.add_argument("--force", action="store_true")
    r = sub.add_parser("run", help="boot and run a command in the project root")
    r.add_argument("--timeout", type=float, default=900.0)
    r.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            t = time.monotonic()
            d = build(args.force)
            print(f"guest: {d} ({time.monotonic() - t:.0f} s)")
            return 0
        cmd = " ".join(a for a in args.command if a != "--")
        rc, out, _ = run(cmd, args.timeout)
        sys.stdout.write(out)
        return rc
    except CheckmateError as e:
        print(f"guest: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
