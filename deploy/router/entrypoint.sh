#!/bin/sh
# The router of docker-compose.scale.yml: vllm-router on :8000 (metrics on :29000) in front of
# every address the compose DNS name $STRATA_REPLICA_HOST (default "strata") resolves to, one
# per replica, with the flags of deploy/router/flags. Replicas added later (docker compose up
# --scale strata=N) join when the router restarts: docker compose restart router.
set -eu
here=$(dirname "$0")
host=${STRATA_REPLICA_HOST:-strata}
workers=""
for ip in $(getent ahostsv4 "$host" | awk '{print $1}' | sort -u); do
    workers="$workers http://$ip:8000"
done
if [ -z "$workers" ]; then
    echo "router: no replica found behind '$host'" >&2
    exit 1
fi
flags=$(grep -v '^#' "$here/flags")
echo "router: replicas$workers"
# shellcheck disable=SC2086  # the worker list and the flags are split on purpose
exec vllm-router --host 0.0.0.0 --port 8000 --prometheus-host 0.0.0.0 --prometheus-port 29000 \
    --worker-urls $workers $flags "$@"
