"""``python -m checkmate.train.run_script SCRIPT ARGS``: one worker of ``checkmate launch``.

Runs the user's script as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, the
script's folder first on ``sys.path``), so that a CheckmateError raised in it -- a bad
environment, shadows that cannot be restored from -- is one line on stderr with exit
status 2, never a traceback. When another rank dies, the survivors' next collective fails
in gloo ("Connection reset by peer"): that is one line too (exit 1), since the launcher is
already restarting the group. Any other exception is the script's own and keeps its
traceback.
"""

from __future__ import annotations

import os
import runpy
import sys

from checkmate.errors import CheckmateError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m checkmate.train.run_script SCRIPT [ARGS ...]", file=sys.stderr)
        return 2
    script = argv[0]
    rank = os.environ.get("RANK", "?")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except CheckmateError as e:
        print(f"checkmate: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        text = str(e)
        if "/gloo/" not in text:
            raise
        why = text.split("] ", 1)[-1].split(". ")[0]
        print(f"checkmate: rank {rank}: a peer of the process group is gone ({why}); "
              "exiting for the launcher to restart the group", file=sys.stderr, flush=True)
        return 1
    except FileNotFoundError as e:
        if e.filename == script:
            print(f"checkmate: rank {rank}: error: no such script {script}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
