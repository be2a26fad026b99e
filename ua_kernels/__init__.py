"""Unified attention on GPU kernels: ``attention(q, k, v, ...)``, the op of the
contract in ua_reference (validation, the cap registry, the reference), with
its gradients.

Two backends, each a package with its launch code, kernels and tuned table:
Pallas-Triton (ua_kernels.triton; every dtype and head dim) and Pallas Mosaic
GPU for Hopper (ua_kernels.mosaic; 16-bit inputs, head dims up to 256). They
share the tile math (ua_kernels.tile_math, softmax_state) and the caps' forms
and precision policy (ua_kernels.cap_forms). ``KernelConfig`` picks the
backend ("auto": Mosaic on Hopper where it can run, else Triton) and the tiles
(``MosaicTiles`` for the Mosaic kernels); fields left unset take the backends'
tuned tables (ua_kernels.tuned_configs). Cap methods are registered in
ua_reference (ua_reference.register_cap_method); a fast bfloat16 form of one
is registered here (register_fast_form).
"""

from .attention import SUPPORTED_DTYPES, attention
from .cap_forms import register_fast_form
from .kernel_config import KernelConfig, MosaicTiles

__all__ = ["attention", "KernelConfig", "MosaicTiles", "SUPPORTED_DTYPES", "register_fast_form"]
