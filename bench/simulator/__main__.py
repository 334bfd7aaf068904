"""``python -m bench.simulator``: the simulator's command line (cli.py)."""
from .cli import main

main()
