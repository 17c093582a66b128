"""Optional C++ CPU kernel for decode attention, built on first use.

Compiled with torch's extension builder (needs a C++ compiler; cached under
TORCH_EXTENSIONS_DIR). If it cannot be built, `load()` returns None and the
torch backend keeps its pure-torch path. PDSERVE_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
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
        from torch.utils.cpp_extension import load as build
        _module = build(name="pdserve_paged_decode", sources=[str(_SOURCE)],
                        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("C++ decode-attention kernel unavailable (%s); using the torch path", exc)
        _module = None
    return _module
