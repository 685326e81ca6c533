#!/bin/sh
# The container's `strata serve`: fixed address and port (publish it with -p / ports:), the disk
# tier under the /data volume, then the flags in $STRATA_ARGS (split on spaces, so no spaces
# inside a value), then the container's command arguments. A later flag wins over an earlier one.
# STRATA_API_KEY, when set and not empty, is read by the server itself. With STRATA_KV_PER_HOST=1
# (replicas sharing one volume: docker-compose.scale.yml) the disk tier is /data/kv/<hostname>.
set -eu
kv=/data/kv
if [ "${STRATA_KV_PER_HOST:-}" = "1" ]; then kv="/data/kv/$(hostname)"; fi
# compose passes an unset variable as "", which the server would take as a key
if [ -z "${STRATA_API_KEY:-}" ]; then unset STRATA_API_KEY; fi
# shellcheck disable=SC2086  # STRATA_ARGS is split into flags on purpose
exec strata serve --host 0.0.0.0 --port 8000 --kv-disk-path "$kv" ${STRATA_ARGS:-} "$@"
