"""kbmesh: an event-driven knowledge base for AI agents."""
