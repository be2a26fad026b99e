"""The contract of unified attention: validation, the cap registry and the
pure-jnp reference (the oracle). It depends on nothing of this project's:
implementations import it, the verification suite judges them by it."""

from .caps import CAP_METHODS, CapMethod, get_cap_method, register_cap_method
from .contract import StaticSpec, Validated, validate, validate_call
from .reference import attention, visible_keys, with_z_loss_gradient

__all__ = ["attention", "visible_keys", "with_z_loss_gradient", "validate", "validate_call",
           "Validated", "StaticSpec",
           "CAP_METHODS", "CapMethod", "get_cap_method", "register_cap_method"]
