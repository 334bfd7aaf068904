#!/usr/bin/env bash
# The main job in one command: install, migrate, create the demo team/user/token, start
# the ASGI server (daphne) and a Celery worker, submit examples/add-async.yaml and
# watch it live. Ctrl-C stops the run (if still going) and the servers.
#   scripts/demo.sh                          # SQLite, filesystem broker, in-memory channel layer
#   DATABASE_URL=postgres://... REDIS_URL=redis://... scripts/demo.sh
#   FLUXRL_PORT=8001 scripts/demo.sh         # another port
#   FLUXRL_DEMO_SPEC=other.yaml scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${FLUXRL_PORT:-8000}
SPEC=${FLUXRL_DEMO_SPEC:-examples/add-async.yaml}
PY=.venv/bin/python
export PYTHONPATH="platform:.${PYTHONPATH:+:$PYTHONPATH}"
export DJANGO_SETTINGS_MODULE=fluxrl.settings
export FLUXRL_PUBLIC_URL=${FLUXRL_PUBLIC_URL:-http://127.0.0.1:$PORT}
LOGS=${FLUXRL_DATA_DIR:-var}/log

scripts/setup.sh
mkdir -p "$LOGS"
if ! "$PY" -c "import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $PORT)) == 0)"; then
  echo "demo: port $PORT is in use; stop what serves it or set FLUXRL_PORT" >&2
  exit 1
fi
TOKEN=$("$PY" manage.py bootstrap_demo)

WEB_PID= WORKER_PID= RUN=
stop_all() {
  trap - INT TERM EXIT
  echo >&2
  if [ -n "$RUN" ]; then  # a run still going is cancelled, so its engine stops cleanly
    FLUXRL_URL=$FLUXRL_PUBLIC_URL FLUXRL_TOKEN=$TOKEN .venv/bin/fluxrl cancel "$RUN" >/dev/null 2>&1 \
      && echo "demo: cancelling run $RUN" >&2 || true
  fi
  for pid in $WORKER_PID $WEB_PID; do  # the worker first: it finishes the cancel, then exits
    kill -TERM -- "-$pid" 2>/dev/null || continue
    for _ in $(seq 60); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  echo "demo: servers stopped (logs in $LOGS/)" >&2
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# Own sessions (setsid): Ctrl-C reaches this script only, which stops them in order.
setsid "$PY" -m daphne -b 127.0.0.1 -p "$PORT" fluxrl.asgi:application >"$LOGS/daphne.log" 2>&1 &
WEB_PID=$!
setsid "$PY" -m celery -A fluxrl worker -Q cpu,gpu --concurrency 1 -B --loglevel INFO >"$LOGS/celery.log" 2>&1 &
WORKER_PID=$!

"$PY" - "$FLUXRL_PUBLIC_URL" "$LOGS/celery.log" <<'EOF'
import sys, time, urllib.error, urllib.request
url, worker_log = sys.argv[1], sys.argv[2]
deadline = time.time() + 120
def web_up():
    try:
        urllib.request.urlopen(f"{url}/api/me/", timeout=2)
    except urllib.error.HTTPError:
        return True  # 401: it answers
    except OSError:
        return False
    return True
while not (web_up() and b" ready." in open(worker_log, "rb").read()):
    if time.time() > deadline:
        sys.exit("demo: the web server or the Celery worker did not start; see the logs")
    time.sleep(0.5)
EOF
echo "demo: web server on $FLUXRL_PUBLIC_URL, Celery worker ready (broker: ${REDIS_URL:-filesystem})"
# The last start-up line: can reward code run here? (a real contained probe, or the reason)
"$PY" -m workers sandbox-check 2>/dev/null | sed 's/^/demo: /' || true

.venv/bin/fluxrl login --url "$FLUXRL_PUBLIC_URL" --token "$TOKEN"
SUBMITTED=$(.venv/bin/fluxrl submit "$SPEC" --tag demo --team demo)
echo "$SUBMITTED"
RUN=$(echo "$SUBMITTED" | sed -n 's/^run \([0-9]*\) .*/\1/p;q')
echo "demo: sign in to the dashboard as demo / demo"
.venv/bin/fluxrl watch "$RUN" && status=0 || status=$?
[ "$status" -eq 130 ] && exit 130
RUN=  # finished: nothing to cancel
echo "demo: the servers keep running for the dashboard; Ctrl-C stops them"
wait
