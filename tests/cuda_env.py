"""What every CUDA test module does before anything imports numba.cuda.

Import it first (``from cuda_env import SIMULATED``): CUDA tests run under
Numba's simulator unless ``NUMBA_ENABLE_CUDASIM=0`` asks for the GPU, and the
importing module is skipped, saying why, when numba.cuda cannot be had.
"""

import os
import sys

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

if "numba" in sys.modules and "numba.cuda" not in sys.modules:
    # numba read NUMBA_* when it was imported (by numcoll's CPU kernels, for a
    # test module collected earlier); re-read so that numba.cuda sees the simulator.
    from numba.core import config as _numba_config

    _numba_config.reload_config()

try:
    from numba import cuda as _numba_cuda
except Exception as exc:  # pragma: no cover - depends on the installation
    pytest.skip(f"numba.cuda is not importable ({exc}); pip install numba-cuda",
                allow_module_level=True)

#: True under Numba's CUDA simulator, False on a real GPU.
SIMULATED = _numba_cuda.jit.__module__.startswith("numba.cuda.simulator")
if not SIMULATED and not _numba_cuda.is_available():
    pytest.skip("numba.cuda was imported without the simulator before this module could "
                "enable it, and there is no GPU: run this module on its own or with "
                "NUMBA_ENABLE_CUDASIM=1 set in the environment", allow_module_level=True)
del _numba_cuda
