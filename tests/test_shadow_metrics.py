"""`shadow serve --metrics-port`: a real shadow process exports its status to Prometheus."""

from __future__ import annotations

import random
import subprocess
import sys
import time
import urllib.request

from checkmate.config import cluster as cfgmod


def test_shadow_serve_exports_metrics():
    ip = f"127.{random.randrange(100, 200)}.{random.randrange(1, 250)}.7"
    p = subprocess.Popen(
        [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition", "1/2",
         "--config", str(cfgmod.default_path()), "--no-register", "--bind", ip, "--port",
         "0", "--restore-port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            if "metrics on " in line:
                url = line.split("metrics on ", 1)[1].strip()
        assert url, p.stderr.read() if p.poll() is not None else "no metrics line"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'checkmate_shadow_commits_total{partition="1"} 0.0' in text
        assert "checkmate_shadow_datagrams_total" in text
        line = p.stdout.readline()  # "... serving udp IP:PORT tcp IP:PORT"
        host, port = line.rsplit("tcp ", 1)[1].strip().rsplit(":", 1)
        from checkmate.train.shadow_client import ShadowClient

        with ShadowClient((host, int(port))) as c:  # status shows the endpoint serving
            assert c.status()["metrics"] == {"alive": True, "refused": {}}
    finally:
        p.terminate()
        p.wait(timeout=20)
    assert p.returncode == 0
