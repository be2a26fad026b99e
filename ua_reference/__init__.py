"""Pure-jnp reference implementation of unified attention (the oracle)."""

from .reference import attention, visible_keys

__all__ = ["attention", "visible_keys"]
