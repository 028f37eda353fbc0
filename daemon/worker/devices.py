"""Per-device memory through ggml's device API.

llama-cpp-python does not bind ggml_backend_dev_*, so they are bound here
with ctypes from its own libggml-base (the library is already loaded; CDLL
returns the same handle). Each device reports free and total bytes: on a GPU
that is its VRAM, on the CPU device the host's RAM.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from daemon.worker.llama_lib import llama

_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@cache
def _ggml() -> ctypes.CDLL | None:
    lib_dir = Path(llama.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        return None
    registry = ctypes.CDLL(str(lib_dir / "libggml.so")) if (lib_dir / "libggml.so").exists() else lib
    registry.ggml_backend_dev_count.restype = ctypes.c_size_t
    registry.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    registry.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    lib.registry = registry
    return lib


def device_memory() -> list[dict[str, object]]:
    """[{name, description, type, free, total}] for every ggml device."""
    lib = _ggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.registry.ggml_backend_dev_count()):
        dev = lib.registry.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({
            "name": (lib.ggml_backend_dev_name(dev) or b"").decode(),
            "description": (lib.ggml_backend_dev_description(dev) or b"").decode(),
            "type": _TYPES.get(lib.ggml_backend_dev_type(dev), "other"),
            "free": free.value,
            "total": total.value,
        })
    return out
