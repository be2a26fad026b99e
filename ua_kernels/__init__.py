"""Unified attention on GPU kernels: ``attention(q, k, v, ...)``, the op of the
contract in ua_reference (validation, the cap registry, the reference), with
its gradients.

Two backends: Pallas-Triton kernels (ua_kernels.kernels; every dtype and head
dim) and Pallas Mosaic GPU kernels for Hopper (ua_kernels.mosaic_forward,
mosaic_backward; 16-bit inputs, head dims up to 256), sharing their tile math
(ua_kernels.tile_math). ``KernelConfig`` picks the backend ("auto": Mosaic on
Hopper where it can run, else Triton) and the tiles (``MosaicTiles`` for the
Mosaic kernels); fields left unset take the tuned table's values
(ua_kernels.tuned_configs). Cap methods are registered in ua_reference
(ua_reference.register_cap_method); a fast bfloat16 form of one is registered
here (register_fast_form).
"""

from .attention import SUPPORTED_DTYPES, attention
from .cap_forms import register_fast_form
from .kernel_config import KernelConfig, MosaicTiles

__all__ = ["attention", "KernelConfig", "MosaicTiles", "SUPPORTED_DTYPES", "register_fast_form"]
