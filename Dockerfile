# The image for web (daphne) and celery-cpu, and with ENGINE=gpu the one for celery-gpu
# (docker-compose.yml). Built with the project's one setup path, scripts/setup.sh (venv,
# install, migrate), which gets ENGINE as FLUXRL_ENGINE.
#   docker build -t fluxrl .                                   # platform + CPU engine
#   docker build --build-arg ENGINE=gpu -t fluxrl-gpu .        # platform + GPU engine, on a CUDA image
#   docker build --build-arg FLUXRL_NO_ENGINE=1 -t fluxrl .    # platform only (or ENGINE=none)
ARG ENGINE=cpu
# The base per engine (BuildKit builds only the one chosen). The CUDA image brings nvcc for
# DeepSpeed's JIT-built ops, CUDA 13.0 as in torch 2.13's wheel, and Python 3.12.
FROM python:3.11-slim AS base-cpu
FROM python:3.11-slim AS base-none
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS base-gpu
FROM base-${ENGINE}

ARG ENGINE
ARG FLUXRL_NO_ENGINE=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/app/platform:/app \
    PATH=/app/.venv/bin:$PATH \
    FLUXRL_DATA_DIR=/data

# The CUDA image has no Python of its own: the system's, for setup.sh's venv.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends build-essential bubblewrap libseccomp2 \
       $(if [ "$ENGINE" = gpu ]; then echo python3 python3-venv python3-dev; fi) \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
# The build's throw-away SQLite database and secret key must not end up in the image.
RUN FLUXRL_ENGINE="$ENGINE" FLUXRL_NO_ENGINE="$FLUXRL_NO_ENGINE" FLUXRL_DATA_DIR=/tmp/build-data scripts/setup.sh \
    && rm -rf /tmp/build-data

# Not root at run time: the code (/app, root's) is read-only to the server and workers; they
# write /data and their home (model and compiler caches). Only compose's `sandbox` service
# runs as root (`user: root`), to drop reward code to its own uid inside bubblewrap.
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin fluxrl \
    && mkdir -p /data && chown fluxrl:fluxrl /data
USER fluxrl

VOLUME ["/data"]
EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "fluxrl.asgi:application"]
