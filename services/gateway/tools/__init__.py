"""The agent tools: the registry (`registry.py`), their text rendering (`rendering.py`), and
the `core` (with `answers` and `sources`) and `compat` toolsets, registered on import."""

from services.gateway.tools import answers, compat, core, sources
from services.gateway.tools.registry import (
    TOOLS,
    TOOLSETS,
    ToolErrorResult,
    ToolOutcome,
    ToolSpec,
    error_outcome,
    run_tool,
    tools_for,
)

__all__ = [
    "TOOLS",
    "TOOLSETS",
    "ToolErrorResult",
    "ToolOutcome",
    "ToolSpec",
    "answers",
    "compat",
    "core",
    "error_outcome",
    "run_tool",
    "sources",
    "tools_for",
]
