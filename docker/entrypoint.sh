#!/bin/sh
# The server command line of the batchstring image. `make test` runs this very script against the
# local tritonserver binary (TRITONSERVER, MODEL_REPOSITORY and extra flags overridden) to prove it.
#   - no remote model control (--model-control-mode=none); admin APIs need a header key nobody
#     holds unless BATCHSTRING_ADMIN_KEY is set
#   - strict readiness; 30 s to drain in-flight requests on SIGTERM (Kubernetes grace period: 45 s)
set -eu
ADMIN_KEY="${BATCHSTRING_ADMIN_KEY:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
RESTRICTED="model-repository,shared-memory,trace,logging:admin-key=${ADMIN_KEY}"
exec "${TRITONSERVER:-tritonserver}" \
  --model-repository="${MODEL_REPOSITORY:-/models}" \
  --model-control-mode=none \
  --strict-readiness=true \
  --exit-timeout-secs=30 \
  --http-restricted-api="${RESTRICTED}" \
  --grpc-restricted-protocol="${RESTRICTED}" \
  "$@"
