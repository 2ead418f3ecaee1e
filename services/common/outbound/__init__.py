"""Calls out of kbmesh: the one egress rule for every outbound address, and model calls
(embedding, chat, rerank) with their retry policy."""
