"""Compile time and compilations of a case, observed through jax.monitoring.

JAX reports each step of turning a function into an executable as an event
with a start and an end (``jax.monitoring``'s time spans): tracing to a jaxpr,
lowering the jaxpr to an MLIR module, and the backend's compile (which, with
the persistent compilation cache on, is the cache's lookup and, on a hit, its
read). The names below are jax's own (``jax._src.dispatch``: JAXPR_TRACE_EVENT,
JAXPR_TO_MLIR_MODULE_EVENT, BACKEND_COMPILE_EVENT), the same in jax 0.10.2 and
0.12; a persistent-cache hit is the plain event ``cache_hits``
(``jax._src.compiler.compile_or_get_cached``).

One clock per process listens to them all; the verifier marks it when a case
starts and reads it when the case ends (cases of a process run one at a time).
A case's compile time is the length of the union of the spans that fall inside
its wall-clock window, so a span nested in another (a trace begun while
lowering) counts once; its compilations are the backend compiles in it, an
implementation's jitted callable, the oracle's and the reference's
executables, and any eager jnp operation of a new shape alike. Time that jax
spends on a cache miss outside these three steps (its dispatch, argument
handling) is not compile time here: compile_seconds is a lower bound.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (TRACE, LOWER, BACKEND_COMPILE)
CACHE_HIT = "/jax/compilation_cache/cache_hits"

_MAX_SPANS = 100_000  # a process's most recent spans; a case reads only its own


@dataclasses.dataclass(frozen=True)
class Mark:
  """Where the clock stood when a case started."""

  wall: float
  compiles: int
  cache_hits: int


class CompileClock:
  """Collects jax's compile spans and counts compilations and cache hits."""

  def __init__(self):
    self._lock = threading.Lock()
    self._spans = collections.deque(maxlen=_MAX_SPANS)
    self.compiles = 0
    self.cache_hits = 0

  def on_span(self, event: str, start: float, end: float, **_):
    if event in COMPILE_EVENTS:
      with self._lock:
        self._spans.append((start, end))
        self.compiles += event == BACKEND_COMPILE

  def on_event(self, event: str, **_):
    if event == CACHE_HIT:
      with self._lock:
        self.cache_hits += 1

  def mark(self) -> Mark:
    with self._lock:
      return Mark(time.time(), self.compiles, self.cache_hits)

  def since(self, mark: Mark) -> dict:
    """Compile seconds, compilations and persistent-cache hits since ``mark``."""
    now = time.time()
    with self._lock:
      spans = [(max(s, mark.wall), min(e, now)) for s, e in self._spans if e > mark.wall]
      compiles, hits = self.compiles - mark.compiles, self.cache_hits - mark.cache_hits
    return {"compile_seconds": union_length(spans), "compiled": compiles, "cache_hits": hits}


def union_length(spans) -> float:
  """Total length covered by (start, end) intervals, overlaps counted once."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(spans):
    if end <= reach:
      continue
    total += end - max(start, reach)
    reach = end
  return total


_CLOCK: CompileClock | None = None
_INSTALL = threading.Lock()


def clock() -> CompileClock:
  """The process's clock, its listeners registered with jax on first use."""
  global _CLOCK
  with _INSTALL:
    if _CLOCK is None:
      from jax import monitoring
      c = CompileClock()
      monitoring.register_event_time_span_listener(c.on_span)
      monitoring.register_event_listener(c.on_event)
      _CLOCK = c
  return _CLOCK


def persistent_cache_on() -> bool:
  """Whether JAX's persistent compilation cache has a directory (--compile-cache)."""
  import jax
  return bool(jax.config.jax_compilation_cache_dir) and bool(
      jax.config.jax_enable_compilation_cache)
