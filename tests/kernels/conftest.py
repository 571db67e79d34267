"""Kernel tests: Triton runs in its interpreter (CPU, float32) on machines without a CUDA GPU."""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
