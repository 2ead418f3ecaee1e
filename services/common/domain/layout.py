"""A document's layout: how its stored text is organised (markdown, code or plain text) and
where its pages or slides begin. Ingest writes it next to the text; embed reads it to chunk
by structure and to give every chunk its page or slide numbers."""

from __future__ import annotations

import bisect
from typing import Literal

from pydantic import BaseModel, Field


class Layout(BaseModel):
    checksum: str = Field(description="checksum of the text this layout describes")
    format: Literal["text", "markdown", "code"] = "text"
    language: str | None = Field(None, description="the programming language of code")
    unit: Literal["page", "slide"] | None = Field(None, description="what `pages` counts")
    pages: list[tuple[int, int]] = Field(
        default_factory=list,
        description="(character offset where it begins, number) of every page or slide",
    )

    def pages_of(self, start: int, end: int) -> list[int]:
        """The numbers of the pages (or slides) that the text span [start, end) touches."""
        if not self.pages:
            return []
        starts = [s for s, _ in self.pages]
        first = max(0, bisect.bisect_right(starts, start) - 1)
        last = max(0, bisect.bisect_left(starts, end) - 1)
        return [number for _, number in self.pages[first : last + 1]]


def layout_object(org_id: str, document_id: str) -> str:
    """Where a document's layout is stored, next to its text."""
    return f"{org_id}/{document_id}/layout"
