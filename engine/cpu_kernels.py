"""Optional C++ CPU kernels (decode attention over the paged cache), built on first use.

Compiled with torch's extension builder (needs a C++ compiler; cached under
TORCH_EXTENSIONS_DIR). If it cannot be built, `load()` returns None and the
torch backend keeps its pure-torch path. PDSERVE_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
_SOURCES = sorted(str(p) for p in (Path(__file__).with_name("csrc")).glob("*.cpp"))
_module = None
_tried = False


def load():
    """The compiled module, or None when disabled or unbuildable."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load as build
        # One build directory per checkout and source version: two checkouts (or an old
        # and a new version) sharing TORCH_EXTENSIONS_DIR never rebuild over each other.
        digest = hashlib.sha256("".join(s + Path(s).read_text() for s in _SOURCES).encode()).hexdigest()[:12]
        build_dir = Path(_get_build_directory("pdserve_cpu_kernels", False) + f"-{digest}")
        build_dir.mkdir(parents=True, exist_ok=True)
        _module = build(name="pdserve_cpu_kernels", sources=_SOURCES, build_directory=str(build_dir),
                        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ CPU kernels unavailable (%s); using the torch paths", exc)
        _module = None
    return _module
