"""Gateway: REST, MCP tools, API keys; publishes events and sends search requests."""
