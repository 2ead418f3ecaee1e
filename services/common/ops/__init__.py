"""Running kbmesh: metrics, telemetry and the data directory's format and lock."""
