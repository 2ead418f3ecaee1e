"""NATS and what kbmesh keeps on it: the bus client and its consumers, bus users and their
permissions, registries (KV buckets) and the text store, request/reply, dead letters, the
audit trail, and the private nats-server."""
