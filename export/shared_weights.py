"""One copy of the weights on disk for the export's two ONNX graphs.

The CPU runs small steps on a graph of their own (layout.SMALL_STEP_GRAPH), traced from the same
weights as model.onnx; written apart, each graph carries its own copy (two 4.9 GB files for a 1B
model in float32). `share_weights` rewrites both graphs so that every weight tensor lives once, in
model.onnx.data: tensors are matched by dtype, shape and bytes (the exporter names the transposed
matrices it makes differently in each graph), each written at a page-aligned offset so that ONNX
Runtime can map the file rather than read it. Lossless: only where the bytes live changes.

Exports whose weights are small stay self-contained files (`SHARE_FROM_BYTES`); the shipped model
is 16 MB per graph.
"""

from __future__ import annotations

import hashlib
import mmap
from contextlib import ExitStack
from pathlib import Path

from batchstring.export.layout import SHARED_WEIGHTS as WEIGHTS_FILE
from batchstring.export.layout import SMALL_STEP_GRAPH

SHARE_FROM_BYTES = 64 << 20  # weights of the full graph from which the two graphs share one file
INLINE_BELOW = 1024  # tensors smaller than this stay inside their graph (onnx's own default threshold)
ALIGN = 4096  # page size: an aligned tensor can be memory-mapped


def graphs(directory: Path) -> list[Path]:
    return [directory / name for name in ("model.onnx", SMALL_STEP_GRAPH) if (directory / name).exists()]


def weight_bytes(directory: Path) -> int:
    """Bytes of the graphs and every file of weights beside them, each counted once."""
    files = {*graphs(directory), *(p for g in graphs(directory) for p in g.parent.glob(f"{g.name}.data"))}
    files |= {directory / WEIGHTS_FILE} if (directory / WEIGHTS_FILE).exists() else set()
    return sum(p.stat().st_size for p in files)


def share_weights(directory: Path, from_bytes: int = SHARE_FROM_BYTES) -> bool:
    """Both graphs' weights in one file, each tensor once (module docstring); False, and nothing
    changed, when there is no second graph or the weights are below `from_bytes`."""
    import onnx

    paths = graphs(directory)
    if len(paths) < 2:
        return False
    models = [onnx.load(str(p), load_external_data=False) for p in paths]
    with ExitStack() as files:
        maps = _Maps(directory, files)
        if sum(maps.size_of(t) for t in models[0].graph.initializer) < from_bytes:
            return False
        scratch = directory / f"{WEIGHTS_FILE}.writing"
        out = files.enter_context(open(scratch, "wb"))
        written: dict[tuple, tuple[int, int]] = {}
        for model in models:
            for tensor in model.graph.initializer:
                data = maps.bytes_of(tensor)
                if len(data) < INLINE_BELOW:
                    _inline(tensor, data)
                    continue
                key = (tensor.data_type, tuple(tensor.dims), hashlib.blake2b(data, digest_size=16).digest())
                if key not in written:
                    out.write(b"\0" * (-out.tell() % ALIGN))
                    written[key] = (out.tell(), len(data))
                    out.write(data)
                _point(tensor, *written[key])
    stale = [p for g in paths for p in g.parent.glob(f"{g.name}.data")]
    scratch.replace(directory / WEIGHTS_FILE)
    for path, model in zip(paths, models):
        onnx.save_model(model, str(path))  # the graph alone: its tensors name their bytes in WEIGHTS_FILE
    for path in stale:
        if path.name != WEIGHTS_FILE:
            path.unlink()
    return True


class _Maps:
    """Read-only maps of the external data files the graphs name, opened once each."""

    def __init__(self, directory: Path, files: ExitStack) -> None:
        self.directory, self.files, self.maps = directory, files, {}

    @staticmethod
    def _external(tensor) -> dict[str, str] | None:
        import onnx

        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return None
        return {entry.key: entry.value for entry in tensor.external_data}

    def size_of(self, tensor) -> int:
        info = self._external(tensor)
        return len(self.bytes_of(tensor)) if info is None else int(info["length"])

    def bytes_of(self, tensor) -> bytes:
        from onnx import numpy_helper

        info = self._external(tensor)
        if info is None:
            return tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        location = info["location"]
        if location not in self.maps:
            with open(self.directory / location, "rb") as handle:  # the map outlives the file handle
                self.maps[location] = self.files.enter_context(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
        offset = int(info.get("offset", 0))
        return self.maps[location][offset : offset + int(info["length"])]


def _inline(tensor, data: bytes) -> None:
    """A small tensor's bytes inside its graph, wherever they were."""
    import onnx

    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = bytes(data)


def _point(tensor, offset: int, length: int) -> None:
    """The tensor's bytes are at `offset` in WEIGHTS_FILE, not in the graph."""
    import onnx

    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL
