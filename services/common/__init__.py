"""What every service imports, by role: `domain` (vocabulary and rules), `messages` (what
travels on the bus), `infra` (bus, registries, store, model calls), `embedders` (local and
LiteLLM embedding models) and `settings`."""
