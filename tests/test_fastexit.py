"""checkmate.fastexit: a command's process ends with its heap frozen (no last garbage
collections), its atexit handlers run and every open stream flushed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_command_ends_frozen_with_its_handlers_run_and_its_files_flushed(tmp_path):
    kept, cyclic = tmp_path / "global.txt", tmp_path / "cycle.txt"
    code = textwrap.dedent(f"""
        import atexit, gc
        # registered before install (as logging's is, at import): runs after its handler
        atexit.register(lambda: print("after", gc.get_freeze_count() > 0, flush=True))
        from checkmate import fastexit

        fastexit.install()
        fastexit.install()  # once is enough: a second call registers nothing more
        f = open({str(kept)!r}, "w")  # left open in the module's globals
        f.write("global")
        def cycle():
            g = open({str(cyclic)!r}, "w")  # left open in a reference cycle
            g.write("cycle")
            loop = [g]
            loop.append(loop)
        cycle()
        # registered later (the command's own): runs before the heap is frozen
        atexit.register(lambda: print("before", gc.get_freeze_count() > 0, flush=True))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["before False", "after True"], p.stdout
    # every open stream was flushed before the freeze: no buffered write is lost
    assert kept.read_text() == "global" and cyclic.read_text() == "cycle"
