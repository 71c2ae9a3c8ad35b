"""The training corpus: the Python standard library's own source files.

Every machine with Python has it, offline, so anyone can retrain the default model and get
the same split. Test suites are left out: they are mostly fixtures and would crowd out the
library code the model should learn to imitate.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIPPED_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_EVERY = 10  # every 10th file (in sorted order) is held out


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[Path]
    held_out: list[Path]

    @staticmethod
    def read(paths: list[Path]) -> list[str]:
        """File texts; undecodable bytes become U+FFFD so no file is silently dropped."""
        return [p.read_bytes().decode("utf-8", errors="replace") for p in paths]


def stdlib_corpus(root: Path | None = None) -> Corpus:
    """Sorted, deterministic train / held-out split of the stdlib's ``*.py`` files."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not SKIPPED_PARTS.intersection(p.relative_to(root).parts)
    )
    if not files:
        raise SystemExit(f"no Python source files found under {root}; pass a corpus directory")
    held_out = files[::HELD_OUT_EVERY]
    held = set(held_out)
    return Corpus(root=root, train=[p for p in files if p not in held], held_out=held_out)
