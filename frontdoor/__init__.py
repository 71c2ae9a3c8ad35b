"""Where requests enter a server: the bounded HTTP and gRPC front door in front of tritonserver.

Triton 2.51 has no flag that bounds a request: its HTTP frontend crashes the whole server on a
multi-MB form-encoded body (upstream server issue 5840) and its gRPC frontend accepts messages up
to 2 GB. So tritonserver listens on loopback only, and this process owns the public ports:
every request is bounded before Triton sees it, only the inference and health routes are
forwarded (no admin API is reachable from outside), and a model that stays unready makes the
process exit so that Docker and Kubernetes restart the container.

Three jobs, a folder each: `gateway/` (the ports, limits, auth, health, proxying; `python -m
batchstring.frontdoor` runs it), `openai_api/` (the `/v1` routes) and `batch_api/` (the Batch API:
store, files, runner, routes).
"""
