"""What every service imports, by role: `domain` (vocabulary and rules), `messages` (what
travels on the bus, and the names of what it keeps), `bus` (NATS: client, credentials,
registries, dead letters, audit), `store` (vectors), `outbound` (egress and model calls),
`ops` (metrics, telemetry, the data dir), `embedders` (local and LiteLLM embedding models)
and `settings`."""
