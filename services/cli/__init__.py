"""The `kbmesh` command line: the commands (`commands.py`), the REST clients it drives
(`api.py`, `ingest.py`, `mcp.py`), backup and restore, and the launcher that runs services
in one process (`runtime.py`)."""
