"""``python -m workers``: the engine CLI (workers/cli/engine.py)."""
import sys

from workers.cli.engine import main

sys.exit(main())
