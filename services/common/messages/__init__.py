"""What travels on the bus between the services: events (`doc.uploaded`, `kb.index`, ...),
search queries and replies, answer requests. The published `contracts/` are exported from
these models; this package is not those contracts."""
