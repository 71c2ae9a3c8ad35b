#!/bin/bash
# The server command line of the batchstring image. `make test` runs this very script against the
# local tritonserver binary (TRITONSERVER, PYTHON, MODEL_REPOSITORY and the ports overridden) to prove it.
#   - tritonserver listens only on Unix sockets in a private directory; the bounded front door
#     (python -m batchstring.frontdoor) owns the public ports: 8000 HTTP, 8001 gRPC, 8002 metrics
#   - no remote model control (--model-control-mode=none); admin APIs are not reachable through the
#     front door, and need a header key besides: BATCHSTRING_ADMIN_KEY_FILE (a mounted secret),
#     BATCHSTRING_ADMIN_KEY, or a random one nobody holds
#   - the OpenAI-compatible API (/v1) on the HTTP port, unless BATCHSTRING_OPENAI=0; API keys, when
#     wanted, from BATCHSTRING_API_KEY_FILE (a mounted secret, one key per line) or BATCHSTRING_API_KEYS
#   - strict readiness
#   - stop (SIGTERM or SIGINT): the front door drains first: readiness off and new requests refused
#     with a retryable UNAVAILABLE at once, admitted requests finish within BATCHSTRING_DRAIN_SECONDS
#     (default 5; cut after it, their clients send them again), then it closes every connection
#     and exits; tritonserver and its model process, holding nothing any more, are killed. Idle
#     stop < 1 s, busy stop <= the drain + 3 s: within `docker stop`'s 10 s; compose and Kubernetes
#     give 15 s (room for a longer BATCHSTRING_DRAIN_SECONDS: keep grace >= drain + 5)
#   - nothing outlives this script: both children get a parent-death signal (setpriv --pdeathsig),
#     and the model process ends itself when tritonserver is gone (model.py), here or as PID 1
#   - the container exits when either process exits, or when the model, once ready, stays unready
#     for BATCHSTRING_EXIT_WHEN_UNREADY seconds (default 60): restart policies act on exits only
set -euo pipefail
SOCKETS="${BATCHSTRING_SOCKETS:-/tmp/batchstring}"
mkdir -p -m 700 "$SOCKETS"
rm -f "$SOCKETS"/*.sock*
if [ -n "${BATCHSTRING_ADMIN_KEY_FILE:-}" ]; then
  ADMIN_KEY="$(cat "$BATCHSTRING_ADMIN_KEY_FILE")"
else
  ADMIN_KEY="${BATCHSTRING_ADMIN_KEY:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
fi
RESTRICTED="model-repository,shared-memory,trace,logging:admin-key=${ADMIN_KEY}"
unset BATCHSTRING_ADMIN_KEY
# Triton's Python backend makes an empty /tmp/python_env_* at load and removes it only in an orderly
# exit, which a killed tritonserver skips: remove ours when we end (in a container /tmp goes anyway;
# outside one, only empty ones that appeared since we started are removed).
SCRATCH_BEFORE="$(ls -d /tmp/python_env_* 2>/dev/null || true)"
remove_scratch() {
  local dir
  for dir in /tmp/python_env_*; do
    if [ -d "$dir" ] && ! grep -qxF "$dir" <<<"$SCRATCH_BEFORE"; then rmdir "$dir" 2>/dev/null || true; fi
  done
}

setpriv --pdeathsig KILL -- "${TRITONSERVER:-tritonserver}" \
  --model-repository="${MODEL_REPOSITORY:-/models}" \
  --model-control-mode=none \
  --strict-readiness=true \
  --exit-timeout-secs=3 \
  --http-address="unix:$SOCKETS/http.sock" \
  --grpc-address="unix:$SOCKETS/grpc.sock" --grpc-port=8001 \
  --metrics-address="unix:$SOCKETS/metrics.sock" \
  --http-restricted-api="${RESTRICTED}" \
  --grpc-restricted-protocol="${RESTRICTED}" \
  "$@" &
TRITON=$!
FRONT_OPTIONS=(--model-dir "${MODEL_REPOSITORY:-/models}/llm/1")
if [ "${BATCHSTRING_OPENAI:-1}" = "0" ]; then FRONT_OPTIONS+=(--no-openai); fi
if [ -f "${BATCHSTRING_API_KEY_FILE:-/nonexistent}" ]; then  # an optional Secret: keys when it is mounted
  FRONT_OPTIONS+=(--api-key-file "$BATCHSTRING_API_KEY_FILE")
fi
setpriv --pdeathsig KILL -- "${PYTHON:-python3}" -m batchstring.frontdoor "${FRONT_OPTIONS[@]}" \
  --host "${BATCHSTRING_HOST:-0.0.0.0}" \
  --http-port "${BATCHSTRING_HTTP_PORT:-8000}" \
  --grpc-port "${BATCHSTRING_GRPC_PORT:-8001}" \
  --metrics-port "${BATCHSTRING_METRICS_PORT:-8002}" \
  --triton-http "$SOCKETS/http.sock" \
  --triton-grpc "unix:$SOCKETS/grpc.sock:8001" \
  --triton-metrics "$SOCKETS/metrics.sock" \
  --triton-pid "$TRITON" \
  --drain-seconds "${BATCHSTRING_DRAIN_SECONDS:-5}" \
  --exit-when-unready "${BATCHSTRING_EXIT_WHEN_UNREADY:-60}" &
FRONT=$!

shutdown() {  # the front door drains (Triton answers its admitted requests), then Triton has nothing left
  kill -TERM "$FRONT" 2>/dev/null || true
  wait "$FRONT" || true
  kill -KILL "$TRITON" 2>/dev/null || true
  wait "$TRITON" || true
  remove_scratch
  exit 0
}
trap shutdown TERM INT

status=0
wait -n "$TRITON" "$FRONT" || status=$?
# Either one ending on its own leaves nothing to drain: requests travel through both. Stop the other now.
kill -KILL "$TRITON" "$FRONT" 2>/dev/null || true
wait || true
remove_scratch
exit $(( status == 0 ? 1 : status ))  # a failure either way: let the container restart
