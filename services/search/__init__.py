"""Search: hybrid queries over the KBs (request/reply in a queue group)."""
