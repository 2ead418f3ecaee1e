"""Ingest: documents, texts and KB membership (consumes doc.*, ocr.done, tags.changed)."""
