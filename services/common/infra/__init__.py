"""Adapters to what kbmesh runs on: the NATS bus and its credentials, request/reply,
registries (KV buckets), the vector store, model calls, egress, metrics, telemetry, the
audit trail and the private nats-server."""
