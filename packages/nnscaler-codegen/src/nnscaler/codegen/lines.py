"""Generated lines of one method body, with the user source of the lines that run ops."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["Lines"]


@dataclass
class Lines:
    """Generated lines; `sources` maps the index of a line that runs an op to the user's source line,
    `open_block` is the ``with``/``if`` header whose block ends at the last line (ops may join it)."""

    lines: List[str] = field(default_factory=list)
    sources: Dict[int, str] = field(default_factory=dict)
    open_block: Optional[Tuple[str, int]] = None  # (header, len(lines) where its block ends)

    def append(self, line: str, source: Optional[str] = None) -> None:
        if source is not None:
            self.sources[len(self.lines)] = source
        self.lines.append(line)

    def extend(self, lines: List[str]) -> None:
        self.lines.extend(lines)

    def nest(self, inner: "Lines", indent: str = "    ") -> None:
        """Append `inner`'s lines indented, keeping their sources."""
        for i, line in enumerate(inner.lines):
            self.append(indent + line, inner.sources.get(i))

    def block_open(self, header: str) -> bool:
        return self.open_block == (header, len(self.lines))

    def open(self, header: str) -> None:
        self.open_block = (header, len(self.lines))
