"""The published contracts and what serves them: `export` writes `contracts/` (JSON Schemas
of events, tools and REST, with `examples`), and `mock` serves those examples as a gateway."""
