#!/usr/bin/env bash
# The test command: install everything (scripts/setup.sh), then run the whole suite.
# Uses PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set, SQLite/in-memory otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
t=$SECONDS
scripts/setup.sh
echo "== phase install: $((SECONDS - t)) s"; t=$SECONDS
# The tiny model the engine tests train: its shipped weights, checked and put in the cache.
.venv/bin/python -m workers bootstrap
echo "== phase model: $((SECONDS - t)) s"; t=$SECONDS
status=0
# Two pytest-xdist workers, one per core (tests/conftest.py schedules them): the engine runs one
# after another on one, the platform's tests on the other, the rest on whichever is free.
# FLUXRL_TEST_WORKERS=0 runs the suite serially. The slow set (pytest -m slow) is not run here.
.venv/bin/python -m pytest -p no:cacheprovider --durations=60 -n "${FLUXRL_TEST_WORKERS:-2}" "$@" \
  || status=$?
echo "== phase tests: $((SECONDS - t)) s (pytest exit $status)"
exit $status
