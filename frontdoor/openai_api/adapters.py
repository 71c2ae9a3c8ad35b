"""The adapters the /v1 routes name as models: the engine's configured ones and the subdirectories
of its watched directory (engine/adapters.py), read as the engine reads them, so `GET /v1/models`
lists what a request may name. The engine has the last word: a name listed here whose files it
refused is answered 404 with its reason."""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "adapter_config.json"  # engine/adapters.py: the file that makes a directory an adapter


class AdapterNames:
    def __init__(self, configured: str = "", watched: Path | None = None) -> None:
        """`configured`: the engine parameter `adapters` (NAME=DIR,...); `watched`: `adapter_dir`."""
        self.configured = [item.partition("=")[0].strip() for item in configured.split(",") if "=" in item]
        self.watched = watched

    def __call__(self) -> list[str]:
        found = []
        if self.watched is not None and self.watched.is_dir():
            found = [d.name for d in sorted(self.watched.iterdir()) if (d / CONFIG_FILE).is_file()]
        return sorted({*self.configured, *found})
