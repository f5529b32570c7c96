"""Shadow registrations (epoch, token, address), kept in a small JSON state file.

The handshake service writes it on every registration and `control deploy` reads it, so a
redeploy keeps the shadows' current sessions instead of resetting them to the config's
address with epoch 0. Epochs only grow: the largest one ever handed out is stored too, so a
restarted service continues above it. Co-located shadows (config ``colocated: true``) do
not register: each attempt of the job's launcher says where it placed them
(``parse_placement``), and ``placed_sessions`` mints their sessions at those nodes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
from dataclasses import asdict, replace
from pathlib import Path

from checkmate.config.cluster import ClusterConfig, Host
from checkmate.control.plan import Registration
from checkmate.errors import CheckmateError

_MAC_RE = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
STATE_ROOT = Path("/run/checkmate")


def default_path(cfg: ClusterConfig) -> Path:
    """/run/checkmate/<prefix>/controller-<switch>.json (removed by `testbed down`)."""
    env = os.environ.get("CHECKMATE_CONTROL_STATE")
    if env:
        return Path(env)
    return STATE_ROOT / cfg.network.prefix / f"controller-{cfg.switch.name}.json"


class SessionStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        #: By shadow host: a partition with replicas has a registration per shadow.
        self.registrations: dict[str, Registration] = {}
        #: Registrations made by instance (host, instance): a late retry of a shadow that
        #: was registered -- even one a newer instance replaced since -- gets its own
        #: session again, never a new epoch (in memory, the newest per host kept).
        self.by_instance: dict[tuple[str, str], Registration] = {}
        self.max_epoch = 0
        #: The current attempt of a launcher-run job (``attempt``): its id and, per
        #: data-parallel group, every rank's ring IP in ring order; the plan's rings follow
        #: it instead of the config's ranks.
        self.attempt = ""
        self.rings: list[list[str]] | None = None
        #: Where the current attempt placed co-located shadows: per partition, every
        #: replica's "IP:PORT" (None for a config of shadow hosts); a repeat must match it.
        self.placement: list[list[str]] | None = None
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise CheckmateError(f"controller state {self.path} is unreadable: {e}") from None
        try:
            self.max_epoch = int(data.get("max_epoch", 0))
            self.attempt = str(data.get("attempt", ""))
            rings = data.get("rings")
            self.rings = None if rings is None else [[str(ip) for ip in r] for r in rings]
            placed = data.get("placement")  # absent in state files of older controllers
            self.placement = None if placed is None else [[str(a) for a in r] for r in placed]
            for r in data.get("registrations", []):
                reg = Registration(**r)
                self.registrations[reg.host] = reg
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckmateError(f"controller state {self.path} is malformed: {e}") from None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        text = json.dumps({
            "max_epoch": self.max_epoch,
            "attempt": self.attempt, "rings": self.rings, "placement": self.placement,
            "registrations": [asdict(r) for _, r in sorted(self.registrations.items())],
        }, indent=1)
        # Every epoch and token is in it: readable by the controller's user only (0600),
        # from the first byte (created so, never chmod-ed after writing).
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(self.path)

    def for_config(self, cfg: ClusterConfig) -> dict[str, Registration]:
        """Registrations (by shadow host) that still fit the config: the host is still a
        shadow of that partition, placed on a trainer node of the config if it is
        co-located, registered for itself if not (a changed config drops the others)."""
        trainers = {h.name for h in cfg.trainers}
        out = {}
        for name, r in self.registrations.items():
            try:
                h = cfg.host(name)
            except CheckmateError:
                continue
            placed = r.node in trainers if h.colocated else not r.node
            if h.role == "shadow" and h.partition == r.partition and placed:
                out[name] = r
        return out

    def new_session(self, cfg: ClusterConfig, body: dict,
                    peer_ip: str | None = None) -> Registration:
        """Validate a register request and mint its session (not stored until commit); a
        repeat of the current registration's ``instance`` (a retry whose reply was lost or
        late) returns that registration itself: same epoch and token, nothing to commit.
        Only the partition's own shadow host, at its configured address and MAC, sending
        from it (``peer_ip``; loopback: a local tool on its behalf) may register the
        partition. ``peer_ip`` is verified by the switch, which binds every port to its
        host's MAC and IP and drops frames from any other source (docs/security.md): a
        register with a forged source address never reaches the controller."""
        p = body.get("partition")
        mine = cfg.shadows_for(p) if isinstance(p, int) and not isinstance(p, bool) else []
        if not mine:
            raise CheckmateError(f"unknown partition {p!r}")
        if cfg.colocated:
            raise CheckmateError(f"partition {p}'s shadows are co-located: the launcher's "
                                 "attempt places them; they do not register")
        h = next((s for s in mine if s.name == body.get("host")), None)
        if h is None:
            raise CheckmateError(f"partition {p} belongs to {', '.join(s.name for s in mine)}"
                                 f", not {body.get('host')!r}")
        ip = body.get("ip", h.ip)
        if ip != h.ip:
            raise CheckmateError(f"{h.name} is at {h.ip}, not {ip!r}")
        if peer_ip is not None and peer_ip != h.ip \
                and not ipaddress.ip_address(peer_ip).is_loopback:
            raise CheckmateError(f"register for {h.name} sent from {peer_ip}: a shadow "
                                 f"registers from its own address")
        mac = str(body.get("mac", h.mac)).lower()
        if not _MAC_RE.match(mac):
            raise CheckmateError(f"bad mac {mac!r}")
        if mac != h.mac.lower():  # the switch binds the port to it: nothing else arrives
            raise CheckmateError(f"{h.name}'s MAC is {h.mac.lower()}, not {mac}")
        port = body.get("port", h.port)
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise CheckmateError(f"bad port {port!r}")
        instance = body.get("instance", "")
        if not isinstance(instance, str) or len(instance) > 64:
            raise CheckmateError("bad instance: a string of at most 64 characters")
        cur = self.registrations.get(h.name)
        if cur is not None and cur.instance:
            self.by_instance.setdefault((h.name, cur.instance), cur)
        old = self.by_instance.get((h.name, instance)) if instance else None
        if old is not None and (old.host, old.ip, old.mac, old.port) == (
                h.name, str(ip), mac, port):
            return old  # a retry of a registration already made: the same session
        epoch = self.max_epoch + 1
        if epoch >= 2**32:
            raise CheckmateError("epoch space exhausted")
        token = secrets.randbits(32) or 1
        return Registration(p, h.name, str(ip), mac, port, epoch, token, instance)

    def attempt_sessions(self, cfg: ClusterConfig) -> dict[str, Registration]:
        """A new session for every registered shadow, all under one new epoch (above every
        epoch handed out), same shadow, fresh token: a new attempt's copies are stamped
        with it, and what the switch stamped for an earlier attempt is refused by the
        shadows once they hold it. Every partition needs a registered shadow (a replica
        that has not registered keeps getting nothing it accepts until it does). Not
        stored until ``commit_attempt``."""
        regs = self.for_config(cfg)
        missing = sorted(set(range(cfg.num_partitions)) - {r.partition for r in regs.values()})
        if missing:
            raise CheckmateError(f"partition(s) {missing} have no registered shadow yet")
        epoch = self.max_epoch + 1
        if epoch >= 2**32:
            raise CheckmateError("epoch space exhausted")
        return {name: replace(r, epoch=epoch, token=secrets.randbits(32) or 1)
                for name, r in regs.items()}

    def placed_sessions(self, cfg: ClusterConfig,
                        placed: list[list[tuple[Host, int]]]) -> dict[str, Registration]:
        """A session for every co-located shadow at the node and UDP port the launcher
        placed it on (``parse_placement``'s answer), all under one new epoch (above every
        epoch handed out), fresh tokens: a new attempt's copies go there stamped with it.
        Not stored until ``commit_attempt``."""
        epoch = self.max_epoch + 1
        if epoch >= 2**32:
            raise CheckmateError("epoch space exhausted")
        out = {}
        for p, reps in enumerate(placed):
            for h, (node, port) in zip(cfg.shadows_for(p), reps, strict=True):
                out[h.name] = Registration(p, h.name, node.ip, node.mac, port, epoch,
                                           secrets.randbits(32) or 1, "", node.name)
        return out

    def commit_attempt(self, attempt: str, rings: list[list[str]],
                       regs: dict[str, Registration],
                       placement: list[list[str]] | None = None) -> None:
        self.attempt, self.rings = attempt, [list(r) for r in rings]
        self.placement = placement
        for reg in regs.values():
            self.registrations[reg.host] = reg
            if reg.instance:  # a late retry of the shadow's register gets this session
                self.by_instance[(reg.host, reg.instance)] = reg
            self.max_epoch = max(self.max_epoch, reg.epoch)
        self.save()

    def known(self, reg: Registration) -> bool:
        """``reg`` was registered before (new_session returned a retry's session)."""
        return bool(reg.instance) and self.by_instance.get((reg.host, reg.instance)) is reg

    def commit(self, reg: Registration) -> None:
        self.registrations[reg.host] = reg
        if reg.instance:
            self.by_instance[(reg.host, reg.instance)] = reg
            mine = [k for k in self.by_instance if k[0] == reg.host]
            for k in mine[:-8]:  # the newest 8 instances per shadow are enough
                del self.by_instance[k]
        self.max_epoch = max(self.max_epoch, reg.epoch)
        self.save()


def parse_placement(cfg: ClusterConfig, shadows: object) -> list[list[tuple[Host, int]]]:
    """An attempt's ``shadows`` (per config partition, every replica's "IP:PORT" in replica
    order: where the launcher started it) as (trainer node, UDP port) pairs, checked whole
    before anything is written: each IP a trainer host of the config, the right number of
    partitions and replicas, no two replicas of a partition on one node (a node's loss would
    take both), no address twice. Every problem is one CheckmateError line."""
    if not isinstance(shadows, list) or not all(
            isinstance(r, list) and all(isinstance(a, str) for a in r) for r in shadows):
        raise CheckmateError('bad shadows: per partition a list of "IP:PORT" strings, one per '
                             "replica in replica order")
    if len(shadows) != cfg.num_partitions:
        raise CheckmateError(f"the attempt places the shadows of {len(shadows)} partition(s), "
                             f"the controller's config has {cfg.num_partitions}")
    by_ip = {h.ip: h for h in cfg.trainers}
    taken: dict[tuple[str, int], str] = {}
    out = []
    for p, reps in enumerate(shadows):
        if len(reps) != cfg.replicas:
            raise CheckmateError(f"the attempt places {len(reps)} replica(s) of partition "
                                 f"{p}, the controller's config has {cfg.replicas}")
        nodes: dict[str, int] = {}
        mine = []
        for r, addr in enumerate(reps):
            where = f"partition {p} replica {r}"
            ip, _, port_s = addr.rpartition(":")
            try:
                ip = str(ipaddress.IPv4Address(ip))
            except ValueError:
                raise CheckmateError(f'{where}: bad address {addr[:64]!r} ("IP:PORT")') from None
            if not port_s.isdecimal() or len(port_s) > 5 or not 1 <= int(port_s) <= 65535:
                raise CheckmateError(f"{where}: bad port {port_s[:16]!r} (1..65535)")
            port = int(port_s)
            node = by_ip.get(ip)
            if node is None:
                raise CheckmateError(f"{where} is placed at {ip}, which is no trainer host of "
                                     "the config")
            if node.name in nodes:
                raise CheckmateError(f"partition {p}'s replicas {nodes[node.name]} and {r} are "
                                     f"both on {node.name} (a node's loss would take both)")
            if (ip, port) in taken:
                raise CheckmateError(f"{taken[ip, port]} and {where} are both placed at "
                                     f"{ip}:{port}")
            nodes[node.name] = r
            taken[ip, port] = where
            mine.append((node, port))
        out.append(mine)
    return out
