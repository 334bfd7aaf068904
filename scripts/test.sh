#!/usr/bin/env bash
# The test command: install everything (scripts/setup.sh), then run the whole suite.
# Uses PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set, SQLite/in-memory otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
