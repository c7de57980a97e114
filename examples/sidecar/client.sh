#!/bin/sh
# A fencelock sidecar client in POSIX shell with curl: acquire with a wait, keep the lease
# alive with keep-alives while the job runs, send the fencing token with the job's writes,
# release. The job stops (and the script exits 3) if a keep-alive says the lease has ended.
#
#   SIDECAR=http://127.0.0.1:7878 sh client.sh nightly-invoices 5
#
# Needs curl; $FENCELOCK_SIDECAR_TOKEN, when set, is sent as the bearer token.
set -eu
sidecar=${SIDECAR:-http://127.0.0.1:7878}
resource=$1
steps=${2:-5}
ttl_ms=${TTL_MS:-3000}

call() { # METHOD PATH [JSON]: prints the body, then the status on a line of its own
  curl -sS -X "$1" ${FENCELOCK_SIDECAR_TOKEN:+-H "Authorization: Bearer $FENCELOCK_SIDECAR_TOKEN"} \
    -H 'Content-Type: application/json' ${3:+-d "$3"} -w '\n%{http_code}\n' "$sidecar$2"
}
field() { # NAME: the value of a flat JSON field read from stdin
  sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" | head -n 1
}

answer=$(call POST /v1/acquire "{\"resource\":\"$resource\",\"ttl_ms\":$ttl_ms,\"wait_ms\":30000}")
if [ "$(printf '%s\n' "$answer" | tail -n 1)" != 200 ]; then
  echo "not acquired: $(printf '%s\n' "$answer" | field message)"
  exit 75
fi
lease=$(printf '%s\n' "$answer" | field lease_id)
token=$(printf '%s\n' "$answer" | field token)
echo "granted $resource token $token"

i=0
while [ "$i" -lt "$steps" ]; do
  # Well within the TTL: one keep-alive per step of a fraction of it.
  if [ "$(call POST "/v1/leases/$lease/keepalive" | tail -n 1)" != 200 ]; then
    echo "lost: the lease has ended; stopped the work"
    exit 3
  fi
  code=$(call POST /v1/fence "{\"resource\":\"$resource\",\"token\":$token}" | tail -n 1)
  if [ "$code" = 409 ]; then
    echo "write $i refused: token $token is stale"
    exit 4
  fi
  echo "write $i accepted with token $token"
  sleep 0.2
  i=$((i + 1))
done

[ "$(call POST "/v1/leases/$lease/release" | tail -n 1)" = 200 ] && echo released
