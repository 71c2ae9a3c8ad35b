"""The bounded gateway: the public ports (HTTP, gRPC, metrics), their limits, API keys, health
and draining, and the proxying of inference to tritonserver's private sockets (`main` starts it)."""
