"""FluxRL settings: every knob is read from the environment here, and only here.

Embedded default (nothing set): SQLite file, filesystem Celery broker and in-memory
channel layer, all under FLUXRL_DATA_DIR. Production: DATABASE_URL and REDIS_URL.
"""
import ipaddress
import os
import secrets
import shlex
import sys
from importlib.util import find_spec
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

REPO_DIR = Path(__file__).resolve().parents[2]


def env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(int(default))).strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_limit(name: str, default: str, scale: int = 1) -> int | None:
    """A number (times scale), or None for "none": no limit."""
    value = os.environ.get(name, default).strip().lower()
    return None if value in {"", "none"} else int(float(value) * scale)


FLUXRL_DATA_DIR = Path(os.environ.get("FLUXRL_DATA_DIR", REPO_DIR / "var")).resolve()
FLUXRL_DATA_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    # Unset: a random key kept in the data folder, so a fresh install is never insecure.
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    key_file = FLUXRL_DATA_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")
if env_bool("DJANGO_HTTPS", False):  # served over HTTPS (behind a TLS-terminating proxy)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", "3600"))

HAS_SIDECAR = find_spec("drf_spectacular_sidecar") is not None

INSTALLED_APPS = [
    "daphne",  # runserver serves ASGI (websockets) too
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    *(["drf_spectacular_sidecar"] if HAS_SIDECAR else []),
    "channels",
    "fluxrl.accounts",
    "fluxrl.datasets",
    "fluxrl.modelstore",
    "fluxrl.rewards",
    "fluxrl.environments",
    "fluxrl.runs",
    "fluxrl.metrics",
    "fluxrl.quotas",
    "fluxrl.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "fluxrl.urls"
WSGI_APPLICATION = "fluxrl.wsgi.application"
ASGI_APPLICATION = "fluxrl.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "fluxrl.dashboard.context_processors.sandbox_warning",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{FLUXRL_DATA_DIR / 'fluxrl.sqlite3'}",
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "60")),
    )
}
if DATABASES["default"]["ENGINE"].endswith("postgresql") and env_bool("FLUXRL_DB_POOL", False):
    # A pool of connections per process (psycopg_pool), on in the ASGI web server (asgi.py):
    # there each request runs in a thread of its own, so without a pool every request pays
    # for a new PostgreSQL backend (and persistent connections leaked one per thread).
    # Django hands the connection back to the pool when the request ends.
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # required by the pool
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": int(os.environ.get("FLUXRL_DB_POOL_MIN", "2")),
        "max_size": int(os.environ.get("FLUXRL_DB_POOL_MAX", "10")),
        "timeout": float(os.environ.get("FLUXRL_DB_POOL_TIMEOUT_S", "10")),  # wait for a free connection
    }
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Wait for the writer lock instead of failing at once (web + celery share the file).
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = FLUXRL_DATA_DIR / "static"
STATICFILES_DIRS = [REPO_DIR / "frontend" / "static"]
FLUXRL_SERVE_STATIC = env_bool("FLUXRL_SERVE_STATIC", True)  # by the ASGI app itself (fluxrl/asgi.py)

# --- Redis: broker, channel layer (optional: unset means the embedded defaults) ---
REDIS_URL = os.environ.get("REDIS_URL", "")

if REDIS_URL:
    # socket_timeout above the layer's 5 s blocking pop: redis-py 8 defaults to 5 s, which
    # makes every idle consumer fail with a TimeoutError (websocket closed with 1011).
    _REDIS_HOST = {"address": REDIS_URL, "socket_timeout": 30}
    # capacity: messages waiting per web process (all its sockets share one Redis list);
    # past it channels-redis drops pushes. 100 (its default) is a few seconds of lag with
    # a few busy runs watched; 1000 rides out bursts (an engine sending its backlog after
    # an outage). Bounded memory all the same: live pushes are at most
    # FLUXRL_LIVE_MAX_POINTS points, and messages expire after 60 s.
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {
        "hosts": [_REDIS_HOST], "capacity": int(os.environ.get("FLUXRL_CHANNEL_CAPACITY", "1000"))}}}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- Celery (namespace CELERY_, read by fluxrl/celery.py) ---
CELERY_BROKER_URL = REDIS_URL or "filesystem://"
_BROKER_DIR = FLUXRL_DATA_DIR / "broker"
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 24 * 3600}  # a run can hold a task for hours
if not REDIS_URL:
    for sub in ("queue", "control"):
        (_BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    # One folder in and out: producers (web) and consumers (celery workers) share it.
    CELERY_BROKER_TRANSPORT_OPTIONS |= {
        "data_folder_in": str(_BROKER_DIR / "queue"),
        "data_folder_out": str(_BROKER_DIR / "queue"),
        "control_folder": str(_BROKER_DIR / "control"),
    }
# Task state lives in the database (Run.status), so results are not kept.
CELERY_RESULT_BACKEND = REDIS_URL or None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "cpu"
# A run goes to the queue its spec names (cpu | gpu): runs.services.enqueue_run calls
# execute_run.apply_async(queue=resources.queue), and a queue given there wins over these
# routes. Every other task (the stale-run reaper) goes to cpu.
CELERY_TASK_ROUTES = {"fluxrl.*": {"queue": "cpu"}}
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# The reaper fails runs whose watcher stopped heart-beating. A process reaps only after a
# full FLUXRL_RUN_STALE_S of its own contact with the database (runs/dispatch.py): workers
# reap one window after they start and while they watch a run; this beat entry (`celery -A
# fluxrl worker -B`, or a `celery -A fluxrl beat` process) covers idle ones. Busy workers take it late: expire it.
CELERY_BEAT_SCHEDULE = {"reap-stale-runs": {"task": "fluxrl.runs.tasks.reap_stale_runs", "schedule": 60.0,
                                            "options": {"expires": 50}}}
CELERY_BEAT_SCHEDULE_FILENAME = str(FLUXRL_DATA_DIR / "celerybeat-schedule")

# --- Run dispatch (fluxrl/runs/dispatch.py) ---
# Where engines report to: the web server as seen from the worker hosts.
FLUXRL_PUBLIC_URL = os.environ.get("FLUXRL_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
# The engine command, before `run SPEC --out ...`; GPU hosts may use another Python environment.
FLUXRL_ENGINE_COMMAND = shlex.split(os.environ.get("FLUXRL_ENGINE_COMMAND", "")) or [sys.executable, "-m", "workers"]
FLUXRL_CANCEL_GRACE_S = float(os.environ.get("FLUXRL_CANCEL_GRACE_S", "10"))  # SIGTERM -> SIGKILL
FLUXRL_HEARTBEAT_S = float(os.environ.get("FLUXRL_HEARTBEAT_S", "5"))
# Runs over several nodes: the address other hosts reach this worker host at (node 0 listens
# there for the others' agents; an agent announces its engines there). Loopback by default.
FLUXRL_NODE_ADDRESS = os.environ.get("FLUXRL_NODE_ADDRESS", "")
FLUXRL_JOIN_TIMEOUT_S = float(os.environ.get("FLUXRL_JOIN_TIMEOUT_S", "900"))  # node r waits this long for node 0
FLUXRL_RUN_STALE_S = float(os.environ.get("FLUXRL_RUN_STALE_S", "60"))  # no heartbeat this long: failed
# Off with Redis, where every process' status changes reach the sockets: a query per
# socket every few seconds only loads the database (see runs/consumers.py).
FLUXRL_WS_STATUS_POLL_S = float(os.environ.get("FLUXRL_WS_STATUS_POLL_S", "0" if REDIS_URL else "3"))

# --- REST API ---
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "fluxrl.accounts.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["fluxrl.api.permissions.IsTeamUser"],
    "DEFAULT_PARSER_CLASSES": ["fluxrl.api.parsers.LimitedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "fluxrl.api.errors.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "FluxRL API",
    "DESCRIPTION": "Datasets, reward functions, runs and their metrics. Authenticate with "
    "`Authorization: Bearer <key>` (a user API token, or a run token for worker endpoints).",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "fluxrl.api.schema.add_error_responses",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "fluxrl.runs.models.RunStatus",
        "TeamRoleEnum": "fluxrl.accounts.models.Role",
    },
}
if HAS_SIDECAR:  # no internet: serve Swagger UI / Redoc from our own static files
    SPECTACULAR_SETTINGS |= {
        "SWAGGER_UI_DIST": "SIDECAR",
        "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
        "REDOC_DIST": "SIDECAR",
    }

# --- FluxRL limits ---
FLUXRL_MAX_UPLOAD_BYTES = int(float(os.environ.get("FLUXRL_MAX_UPLOAD_MB", "64")) * 1024 * 1024)
# The normalized rows a dataset version stores (what a Parquet/Arrow file or a datasets folder
# expands to), checked as they are written: compressed columns can be far larger than the upload.
FLUXRL_MAX_DATASET_BYTES = int(float(os.environ.get("FLUXRL_MAX_DATASET_MB", "1024")) * 1024 * 1024)
# One row of a dataset as stored JSON (a JSONL line, a CSV record, a decoded Parquet/Arrow row):
# a longer one is refused before the web process parses it, so one row cannot take the web
# process's memory (a few KB of Parquet can decode to one row of hundreds of MB).
FLUXRL_DATASET_MAX_ROW_BYTES = int(os.environ.get("FLUXRL_DATASET_MAX_ROW_BYTES", str(1024 * 1024)))
# Parquet/Arrow files are decoded in a child process with this address-space cap and wall
# clock (fluxrl/datasets/convert.py): a small file can expand to gigabytes when decoded.
FLUXRL_DATASET_CONVERT_MEMORY_MB = int(os.environ.get(
    "FLUXRL_DATASET_CONVERT_MEMORY_MB", max(1024, 2 * FLUXRL_MAX_DATASET_BYTES // 2**20)))
FLUXRL_DATASET_CONVERT_TIMEOUT_S = float(os.environ.get("FLUXRL_DATASET_CONVERT_TIMEOUT_S", "600"))
# Where an operator puts Hugging Face datasets folders (save_to_disk) that teams may import by
# path: each team sees only FLUXRL_DATASET_IMPORT_ROOT/<team slug>/. Unset: import by path is off
# (a team can still upload the folder as an archive).
FLUXRL_DATASET_IMPORT_ROOT = (Path(os.environ["FLUXRL_DATASET_IMPORT_ROOT"]).resolve()
                              if os.environ.get("FLUXRL_DATASET_IMPORT_ROOT") else None)
# A model folder's archive and its unpacked files (POST /api/models/): each at most this (the
# web server holds an upload while it arrives: larger models belong in FLUXRL_MODEL_ROOTS).
FLUXRL_MAX_MODEL_BYTES = int(float(os.environ.get("FLUXRL_MAX_MODEL_MB", "1024")) * 1024 * 1024)
# Each JSON file of a model folder the platform parses (config.json, tokenizer_config.json, the
# shard index, ...): at most this, refused before it is read (the vocabularies tokenizer.json and
# vocab.json are not parsed here and count only toward FLUXRL_MAX_MODEL_MB).
FLUXRL_MAX_MODEL_JSON_BYTES = int(float(os.environ.get("FLUXRL_MAX_MODEL_JSON_MB", "4")) * 1024 * 1024)
# MLflow servers a run's report.mlflow.tracking_uri may name (comma-separated origins,
# https://mlflow.internal:5000): workers post to it from inside the cluster, so it is the
# operator's list, not a team's choice. Empty: local file stores only.
FLUXRL_MLFLOW_SERVERS = [s.strip() for s in os.environ.get("FLUXRL_MLFLOW_SERVERS", "").split(",") if s.strip()]
# Each team's namespace on the shared trackers, {team} being its slug: a run's MLflow
# experiment on a server (or on the workers' MLFLOW_TRACKING_URI) must start with the
# first, a W&B online run's project with the second, and its entity is the operator's
# FLUXRL_WANDB_ENTITY when that is set; names a spec leaves out are filled in inside the
# namespace. The separators are characters a slug cannot hold ('/' and '.'), so no team's
# prefix starts another's; W&B project names may not contain '/'. Empty: no rule.
FLUXRL_MLFLOW_EXPERIMENT_PREFIX = os.environ.get("FLUXRL_MLFLOW_EXPERIMENT_PREFIX", "{team}/")
FLUXRL_WANDB_PROJECT_PREFIX = os.environ.get("FLUXRL_WANDB_PROJECT_PREFIX", "{team}.")
FLUXRL_WANDB_ENTITY = os.environ.get("FLUXRL_WANDB_ENTITY", "").strip()
FLUXRL_INGEST_MAX_POINTS = int(os.environ.get("FLUXRL_INGEST_MAX_POINTS", "1000"))
FLUXRL_INGEST_MAX_SAMPLES = int(os.environ.get("FLUXRL_INGEST_MAX_SAMPLES", "500"))
FLUXRL_INGEST_MAX_BYTES = int(os.environ.get("FLUXRL_INGEST_MAX_BYTES", str(1024 * 1024)))
# A sample's per-token texts (the run page's exact token view): at most this many tokens,
# each at most this many characters.
FLUXRL_SAMPLE_MAX_TOKENS = int(os.environ.get("FLUXRL_SAMPLE_MAX_TOKENS", "16384"))
FLUXRL_SAMPLE_MAX_TOKEN_CHARS = 200
# The run page warns when a step's trainer/engine mismatch at staleness 0 (mismatch/kl_stale0,
# the mean per-token k3 estimate of KL(π_behav‖π_prox) where both are the same weights, so the
# numerics alone; stale tokens add the policy's drift, expected in async runs) passes this: bf16 numerics on a healthy setup stay
# near 1e-3, and well past 1e-2 the importance weights stop being a small correction.
FLUXRL_MISMATCH_KL_WARN = float(os.environ.get("FLUXRL_MISMATCH_KL_WARN", "0.01"))
# How ingested points reach PostgreSQL: copy (binary COPY; a batch holding stored points
# falls back to unnest), unnest (one INSERT ... ON CONFLICT DO NOTHING of arrays, the
# path before COPY) or orm (bulk_create); bench/ingest.py --insert compares them.
FLUXRL_INGEST_INSERT = os.environ.get("FLUXRL_INGEST_INSERT", "copy")
# Points per live push of an ingested batch (more are downsampled per key for the browsers).
FLUXRL_LIVE_MAX_POINTS = int(os.environ.get("FLUXRL_LIVE_MAX_POINTS", "1000"))
FLUXRL_METRICS_MAX_POINTS = int(os.environ.get("FLUXRL_METRICS_MAX_POINTS", "10000"))  # per series, per read
FLUXRL_REWARD_CODE_MAX_BYTES = 64 * 1024
# A team environment's code (POST /api/environments/); a larger upload is refused (400 on code).
FLUXRL_ENVIRONMENT_CODE_MAX_BYTES = int(os.environ.get("FLUXRL_ENVIRONMENT_CODE_MAX_BYTES", str(64 * 1024)))
FLUXRL_REWARD_TRY_MAX_ROWS = 20
FLUXRL_REWARD_TRY_MAX_TIMEOUT_S = 5.0
# A "try it" call is bounded: rows x per-row timeout <= FLUXRL_TRY_MAX_SECONDS, and at most
# FLUXRL_TRY_MAX_CONCURRENT tries run at once per web process (more get a 429).
FLUXRL_TRY_MAX_SECONDS = float(os.environ.get("FLUXRL_TRY_MAX_SECONDS", "10"))
FLUXRL_TRY_MAX_CONCURRENT = int(os.environ.get("FLUXRL_TRY_MAX_CONCURRENT", "2"))
# Prompt previews (POST /api/prompt-preview/) being made at once per web process; more get a 429.
FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT = int(os.environ.get("FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT", "4"))
# A preview (row generation, templates and tokens) stops after this; it answers 503 (fluxrl.runs.preview).
FLUXRL_PROMPT_PREVIEW_DEADLINE_S = float(os.environ.get("FLUXRL_PROMPT_PREVIEW_DEADLINE_S", "15"))
FLUXRL_RUN_TOKEN_TTL_HOURS = float(os.environ.get("FLUXRL_RUN_TOKEN_TTL_HOURS", "168"))  # 0 = until the run ends
# Ordinary JSON bodies (run specs, reward code); uploads and ingest have their own limits.
DATA_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("FLUXRL_LOG_LEVEL", "INFO")},
}

# --- Deployment: the sandbox service and the cluster-key secret (docker-compose.yml) ---
# FLUXRL_TRY_QUEUE: the Celery queue of the sandbox service (`sandbox` in compose). Set, the
# web process never runs reward code: try-it goes to that queue and the web process waits at
# most FLUXRL_TRY_DEADLINE_S for the answer (503 past it). Unset (the embedded default):
# a sandbox child of the web process scores. Needs Redis (the answer comes back through it).
FLUXRL_TRY_QUEUE = os.environ.get("FLUXRL_TRY_QUEUE", "")
FLUXRL_TRY_DEADLINE_S = float(os.environ.get("FLUXRL_TRY_DEADLINE_S", str(FLUXRL_TRY_MAX_SECONDS + 10)))
if FLUXRL_TRY_QUEUE and not REDIS_URL:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("FLUXRL_TRY_QUEUE needs REDIS_URL: the sandbox service's answers come back through Redis")
# The secret each run's cluster key is derived from (runs/dispatch.py cluster_key), given to
# the Celery workers only: not the Django secret, which stays with the web process. Unset
# (the embedded default, one host): the Django secret.
FLUXRL_CLUSTER_KEY_SECRET = os.environ.get("FLUXRL_CLUSTER_KEY_SECRET", "") or SECRET_KEY
# Shared engine pools (runs/tickets.py): the Ed25519 key the platform signs each run's pool
# ticket (its tenant and weight) with, made on first use; its public half is written beside
# it (".pub") for the pools. Never in a run's environment. Unset: FLUXRL_DATA_DIR /
# pool-tickets.ed25519. A ticket is good for FLUXRL_POOL_TICKET_TTL_S: a run's engine joins a
# pool at start, and again only if the pool restarts under it.
FLUXRL_POOL_TICKET_KEY_FILE = os.environ.get("FLUXRL_POOL_TICKET_KEY_FILE", "")
FLUXRL_POOL_TICKET_TTL_S = float(os.environ.get("FLUXRL_POOL_TICKET_TTL_S", str(30 * 86400)))

# --- Request limits: body cap, rates, websocket re-checks ---
# Request bodies above this are refused (413) by fluxrl/asgi.py before Django reads them;
# above FLUXRL_MAX_UPLOAD_MB by default, so a dataset upload's multipart overhead fits.
FLUXRL_MAX_BODY_BYTES = int(float(os.environ.get("FLUXRL_MAX_BODY_MB", str(FLUXRL_MAX_UPLOAD_BYTES / 2**20 + 1)))
                            * 1024 * 1024)
# DRF throttles (fluxrl/api/throttles.py): API requests per signed-in user (run tokens are
# not counted), and failed password sign-ins per client address; "N/s|min|hour|day", or
# "none" for no limit. Counted in Django's cache (per web process by default).
REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"] = ["fluxrl.api.throttles.ApiUserRateThrottle"]
REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] = {
    scope: None if rate.strip().lower() in {"", "none", "0"} else rate.strip()
    for scope, rate in (("user", os.environ.get("FLUXRL_API_RATE", "6000/min")),
                        ("login", os.environ.get("FLUXRL_LOGIN_RATE", "10/min")),
                        ("login_user", os.environ.get("FLUXRL_LOGIN_USER_RATE", "20/hour")))}
# Rates count the peer address (REMOTE_ADDR); X-Forwarded-For is read only behind the proxies
# named here (fluxrl/api/throttles.py client_address): FLUXRL_TRUSTED_PROXIES, comma-separated
# addresses/CIDRs, or FLUXRL_NUM_PROXIES, proxies every request passes through.
FLUXRL_TRUSTED_PROXIES = env_list("FLUXRL_TRUSTED_PROXIES", "")
for _proxy in FLUXRL_TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"FLUXRL_TRUSTED_PROXIES: {_proxy!r} is not an address or CIDR") from None
FLUXRL_NUM_PROXIES = int(os.environ.get("FLUXRL_NUM_PROXIES") or 0)
MIDDLEWARE = [*MIDDLEWARE, "fluxrl.api.throttles.LoginThrottleMiddleware"]
# A run's websocket re-checks this often that its user may still follow the run (membership,
# token), and closes with 4404 (membership) or 4401 (token, user) when not.
FLUXRL_WS_RECHECK_S = float(os.environ.get("FLUXRL_WS_RECHECK_S", "30"))

# --- Quotas: per-team defaults (an admin overrides them per team in the Django admin:
# quotas.TeamQuota) and per-run ceilings; "none" = no limit. Live runs (queued, starting,
# running) count towards runs, engines and nodes (fluxrl/quotas/services.py).
FLUXRL_QUOTA_RUNS = env_limit("FLUXRL_QUOTA_RUNS", "32")
FLUXRL_QUOTA_ENGINES = env_limit("FLUXRL_QUOTA_ENGINES", "128")
FLUXRL_QUOTA_NODES = env_limit("FLUXRL_QUOTA_NODES", "64")  # every live run holds one at least
FLUXRL_QUOTA_STORAGE_BYTES = env_limit("FLUXRL_QUOTA_STORAGE_MB", "51200", 1024 * 1024)  # 50 GiB
FLUXRL_QUOTA_FILES = env_limit("FLUXRL_QUOTA_FILES", "20000")
# Per person, across every team they are in (the runs they submitted, the versions they
# uploaded): a new team brings no new room. Unset: the team default's value. An admin sets a
# person's own in quotas.UserQuota.
FLUXRL_QUOTA_USER_RUNS = env_limit("FLUXRL_QUOTA_USER_RUNS", os.environ.get("FLUXRL_QUOTA_RUNS", "32"))
FLUXRL_QUOTA_USER_STORAGE_BYTES = env_limit("FLUXRL_QUOTA_USER_STORAGE_MB",
                                            os.environ.get("FLUXRL_QUOTA_STORAGE_MB", "51200"), 1024 * 1024)
FLUXRL_QUOTA_USER_FILES = env_limit("FLUXRL_QUOTA_USER_FILES", os.environ.get("FLUXRL_QUOTA_FILES", "20000"))
# Per organisation, over all its teams (quotas.OrganisationQuota overrides); unset: no limit.
FLUXRL_QUOTA_ORG_RUNS = env_limit("FLUXRL_QUOTA_ORG_RUNS", "none")
FLUXRL_QUOTA_ORG_STORAGE_BYTES = env_limit("FLUXRL_QUOTA_ORG_STORAGE_MB", "none", 1024 * 1024)
FLUXRL_QUOTA_ORG_FILES = env_limit("FLUXRL_QUOTA_ORG_FILES", "none")
# Who may create a team through the API (POST /api/teams/): "staff" (is_staff users, the
# operators) or "anyone" signed in. Each team is a tenant with its own quotas, so on a
# shared install letting anyone make teams lets anyone make room for themselves.
FLUXRL_TEAM_CREATION = os.environ.get("FLUXRL_TEAM_CREATION", "staff").strip().lower()
if FLUXRL_TEAM_CREATION not in {"staff", "anyone"}:
    raise ImproperlyConfigured(f"FLUXRL_TEAM_CREATION: {FLUXRL_TEAM_CREATION!r} is neither 'staff' nor 'anyone'")
FLUXRL_MAX_ENGINES_PER_RUN = env_limit("FLUXRL_MAX_ENGINES_PER_RUN", "64")
FLUXRL_MAX_NODES_PER_RUN = env_limit("FLUXRL_MAX_NODES_PER_RUN", "16")
# A run's total work: the most tokens it can generate, every completion at rollout.max_tokens
# (workers.spec.run_work). Training: max_steps x batch_prompts x group_size x max_tokens; one
# eval set at one evaluation: its prompts x n x max_tokens; every evaluation of the run: (the
# held-out prompts x (1 + eval.samples) + the sets' prompts x n) x max_tokens x evaluations.
# The defaults pass a long reasoning run (1000 steps x 512 prompts x 16 samples x 20k tokens is
# 1.7e14) and refuse specs no deployment can serve.
FLUXRL_MAX_TRAIN_TOKENS_PER_RUN = env_limit("FLUXRL_MAX_TRAIN_TOKENS_PER_RUN", "1e15")
FLUXRL_MAX_EVAL_SET_TOKENS = env_limit("FLUXRL_MAX_EVAL_SET_TOKENS", "1e11")
FLUXRL_MAX_EVAL_TOKENS_PER_RUN = env_limit("FLUXRL_MAX_EVAL_TOKENS_PER_RUN", "1e13")
