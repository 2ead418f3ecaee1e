"""The rules of kbmesh's vocabulary: KBs, documents and chunks (`models`), ids, errors,
limits, and what content is accepted (`content`, `formats`, `layout`). Imports nothing else
of kbmesh."""
