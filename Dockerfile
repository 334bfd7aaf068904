# One image for web (daphne), celery-cpu and celery-gpu (docker-compose.yml).
# Built with the project's one setup path, scripts/setup.sh (venv, install, migrate).
#   docker build -t fluxrl .                                   # platform + CPU engine
#   docker build --build-arg FLUXRL_NO_ENGINE=1 -t fluxrl .    # platform only
FROM python:3.11-slim

ARG FLUXRL_NO_ENGINE=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/app/platform:/app \
    PATH=/app/.venv/bin:$PATH \
    FLUXRL_DATA_DIR=/data

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
# The build's throw-away SQLite database and secret key must not end up in the image.
RUN FLUXRL_NO_ENGINE="$FLUXRL_NO_ENGINE" FLUXRL_DATA_DIR=/tmp/build-data scripts/setup.sh \
    && rm -rf /tmp/build-data \
    && mkdir -p /data

VOLUME ["/data"]
EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "fluxrl.asgi:application"]
