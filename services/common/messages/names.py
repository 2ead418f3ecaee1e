"""Names of what kbmesh keeps on the bus besides its subjects: KV buckets, the object store and
the audit stream. Every module takes them from here."""

from __future__ import annotations

# The API-key bucket, written by the operator only.
KEYS_BUCKET = "keys"
KV_BUCKETS = ("kbs", "documents", "index", KEYS_BUCKET, "prompts")
OBJECT_STORE = "texts"
AUDIT_STREAM = "KBMESH_AUDIT"
AUDIT_PREFIX = "audit."
