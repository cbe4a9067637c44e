"""Following files that other processes write: new complete lines of a growing file (the workers'
JSON events, a training command's log and step file), and the tail of a log."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["LineFollower", "EventFollower", "file_size", "tail"]


class _Lines:
    """The complete new pieces of a growing file, split on `separators` (a regex); a piece not yet
    ended waits in the buffer for the next read."""

    separators = rb"\n"

    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, b""

    def _pieces(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *pieces, self.buf = re.split(self.separators, self.buf)
        return pieces


class LineFollower(_Lines):
    """Complete new lines (split on \\n and \\r: progress bars) of a growing text file."""

    separators = rb"[\r\n]"

    def read(self) -> list[str]:
        return [ln.decode("utf-8", "replace") for ln in self._pieces() if ln]

    def rest(self) -> list[str]:
        tail, self.buf = self.buf, b""
        return [tail.decode("utf-8", "replace")] if tail else []


class EventFollower(_Lines):
    """The JSON objects of the complete new lines of a growing JSONL file (garbled lines skipped)."""

    def read(self) -> list[dict[str, Any]]:
        out = []
        for ln in self._pieces():
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
        return out


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tail(path: Path, n: int = 200_000, start: int = 0) -> str:
    """The last n bytes of a log, from byte `start` on."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
