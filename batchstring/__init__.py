"""batchstring, run from a checkout.

Installed, `batchstring` is a namespace shared by two distributions: `batchstring-client` (the
SDK, `batchstring.client`) and `batchstring` (the server: `batchstring.engine`, `.server`, ...).
In a checkout the subpackages are the repository's top-level folders (client/, engine/, ...),
the layout a reader sees; this file makes them importable under their installed names, so that
`python3 -m batchstring.cli gpu-check` runs from a plain checkout with nothing installed.
"""

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "model_repository").is_dir() and (_CHECKOUT / "engine" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))
