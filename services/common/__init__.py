"""What every service imports: events, settings, bus wiring, registries, store, embedders."""
