"""OpenAI's Batch API, durable: the store (SQLite or PostgreSQL, shared by replicas) and its
files, the runner that leases and completes batches through the OpenAI routes, its share of the
server beside interactive traffic, and the `/v1/files` and `/v1/batches` routes."""
