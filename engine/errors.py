"""Errors the engine distinguishes, because callers treat them differently."""


class InvalidRequest(ValueError):
    """The caller's input is wrong; the message says what was wrong and what is allowed."""


class EngineBroken(RuntimeError):
    """The engine cannot run steps any more (the device fails every step): every request it held
    has been answered with a retryable error; its host should restart it."""


def is_out_of_memory(exc: BaseException) -> bool:
    """CPU MemoryError, CUDA OOM from torch, or an ONNX Runtime arena allocation failure."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate memory" in text
