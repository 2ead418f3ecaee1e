"""Embed: chunking, embedding and the vectors (consumes kb.index, kb.remove)."""
