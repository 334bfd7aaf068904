#!/usr/bin/env bash
# The test command: install everything (scripts/setup.sh), then run the whole suite.
# Uses PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set, SQLite/in-memory otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The tiny model the engine tests train (built once per machine, a few minutes; cached).
.venv/bin/python -m workers bootstrap
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
