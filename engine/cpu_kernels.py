"""Optional C++ CPU kernels (decode attention over the paged cache), built on first use.

Compiled with torch's extension builder (needs a C++ compiler; cached under
TORCH_EXTENSIONS_DIR) for this machine's CPU (-march=native: the AVX-512 paths
where it has AVX-512, the portable ones elsewhere). `build(march)` compiles for
another target, e.g. x86-64-v3 (AVX2, no AVX-512), so those paths can be tested
on any x86 machine. If it cannot be built, `load()` returns None and the torch
backend keeps its pure-torch path. PDSERVE_CPU_KERNELS=0 turns it off;
PDSERVE_CPU_KERNELS_MARCH sets the target `load()` builds for (default native).
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_SOURCES = sorted(str(p) for p in (Path(__file__).with_name("csrc")).glob("*.cpp"))
_module = None
_tried = False


def load() -> ModuleType | None:
    """The module compiled for this CPU, or None when disabled or unbuildable."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        _module = build(os.environ.get("PDSERVE_CPU_KERNELS_MARCH", "native"))
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ CPU kernels unavailable (%s); using the torch paths", exc)
        _module = None
    return _module


def build(march: str = "native") -> ModuleType:
    """The kernels compiled with -march=`march` (reused when already built); raises when the build fails."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build_extension

    cflags = ["-O3", f"-march={march}", "-ffast-math", "-fopenmp"]
    # One module name, hence one build directory, per checkout, source version, flags and (for
    # native) CPU: two checkouts, an old and a new version, two targets or two kinds of machine
    # sharing TORCH_EXTENSIONS_DIR never rebuild over (or load) each other's build, and torch never
    # renames a module whose flags differ within one process.
    key = "".join(s + Path(s).read_text() for s in _SOURCES) + " ".join(cflags)
    if march == "native":
        key += _cpu_features()
    name = f"pdserve_cpu_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return build_extension(name=name, sources=_SOURCES, build_directory=_get_build_directory(name, False),
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


def _cpu_features() -> str:
    """The instruction sets this CPU has, as torch sees them ('' where torch cannot say)."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return ""
    return " ".join(sorted(feature for feature, value in capabilities().items() if value is True))
