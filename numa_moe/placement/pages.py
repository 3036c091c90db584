"""Page sizes by name: the one rule that turns ``"4k"`` / ``"2m"`` into bytes.

``"4k"`` is the base page; ``"2m"`` a transparent huge page (the x86-64 PMD size). The
memory layer allocates with either; tables, the store, the layer and the CLI take the
same names, so each of them asks here instead of keeping its own list. Pure Python (no
native module), so the CLI can build its choices without loading the extension.
"""

from __future__ import annotations

import numbers

__all__ = ["PAGE_BYTES", "PAGE_CHOICES", "page_name", "page_bytes_of"]

PAGE_BYTES = {"4k": 4096, "2m": 2 << 20}
PAGE_CHOICES = tuple(PAGE_BYTES)


def page_name(page: str) -> str:
    """The canonical name of a page size (``" 4K "`` -> ``"4k"``); ValueError otherwise."""
    key = page.strip().lower() if isinstance(page, str) else None
    if key not in PAGE_BYTES:
        names = " or ".join(repr(name) for name in PAGE_CHOICES)
        raise ValueError(f"page must be {names}, got {page!r}")
    return key


def page_bytes_of(page: str | int) -> int:
    """Bytes of a page size given by name (``"4k"`` -> 4096, ``"2m"`` -> 2 MiB) or, for
    callers that already hold a size, as a positive int of bytes."""
    if isinstance(page, bool):
        raise TypeError(f"page must be a page-size name or a number of bytes, got {page!r}")
    if isinstance(page, numbers.Integral):
        page_bytes = int(page)
        if page_bytes < 1:
            raise ValueError(f"page must be a positive number of bytes, got {page_bytes}")
        return page_bytes
    return PAGE_BYTES[page_name(page)]
