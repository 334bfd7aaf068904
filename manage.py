#!/usr/bin/env python
"""Django's command-line entry. platform/ is a plain folder (not a package), so that
`import platform` keeps meaning the standard library; it goes on sys.path here."""
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    root = Path(__file__).resolve().parent
    sys.path[:0] = [str(root / "platform"), str(root)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fluxrl.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
