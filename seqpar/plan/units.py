"""Units shared by every layer, defined once (dependency-free, so the runtime and the advisor both import it).

The schema's field names carry their unit: ``_gib`` = GiB = 2**30 bytes, ``_gb_s`` = 10**9 bytes per second per
direction, ``_tflops`` = 10**12 FLOP/s, ``_s`` = seconds.
"""

from __future__ import annotations

GIB = 2**30  # bytes in a GiB (what torch.cuda.max_memory_allocated / 2**30 and NVML's MiB / 1024 report)

__all__ = ["GIB"]
