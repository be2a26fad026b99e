"""The exact mask property: the set of keys each query sees, read out of the
implementation's forward and of both backward products, compared bit for bit
with the contract's ``visible_keys``.

A leaked or dropped key moves an output by about its weight, 1/n of a row of
n visible keys, which a max-abs tolerance lets through at long T (a causal
leak of 15 future keys at T = 4096 stays inside the bfloat16 bound,
docs/TOLERANCES.md). Here inputs encode key and query indices instead, so that
every visible (query, key) pair gives a nonzero element and every hidden one
an exact zero, whatever T:

- ``q`` is zero except one-hot rows, ``k`` and ``v`` one-hot rows: batch row
  ``r`` of a call checks key chunk ``c`` = [c*D, (c+1)*D), whose key c*D + e
  has ``k = v = e_e`` (all other keys zero) and whose query c*D + e has
  ``q = QUERY_SCALE * e_e``. Every logit is then temperature * cap(0) but the
  chunk's diagonal, temperature * cap(sm_scale * QUERY_SCALE): probabilities
  are all positive on visible keys, never underflowing;
- forward: ``out[i, e] = p[i, c*D + e]``, nonzero exactly where query i sees
  key c*D + e (the forward kernel's key loop);
- ``dout`` one-hot like ``v`` over the chunk's queries: ``dv[j, e]`` sums
  ``p[c*D + e, j]`` over the group's query heads (the dk/dv kernel's query
  loop);
- with ``return_lse`` and an lse cotangent of LSE_COTANGENT, ``ds[i, j]`` is
  about LSE_COTANGENT * p[i, j], positive on visible pairs: ``dq[i, e]`` is
  sm_scale * cap' * ds[i, c*D + e] (the dq kernel's loop) and ``dk[j, e]`` the
  group's sum of sm_scale * cap' * QUERY_SCALE * ds[c*D + e, j].

Temperatures are replaced by ones of the same shape: they scale these
elements, never the mask; an extreme one (1e-3) would push float16 gradients
below the smallest subnormal, and signs differing within a GQA group would let
dk's sum over the group cancel to zero. Chunks are batched into calls of at most
ELEMENT_BUDGET elements per input, so that T = 16k costs a few calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ua_reference import visible_keys
from ua_reference.caps import CAP_METHODS

from ..model.case import Case
from ..model.inputs import DTYPES, make_inputs
from ..judge.runner import evaluate_arrays
from ..judge.tolerance import OutputError

QUERY_SCALE = 2.0 ** -3  # keeps sm_scale * QUERY_SCALE below every drawn cap (>= sm_scale / 4 * sqrt(D))
LSE_COTANGENT = 1024.0  # makes float16 dk of T = 16k rows (about 1e-4) a normal number
ELEMENT_BUDGET = 1 << 25  # elements of one [B, T, Hq, D] input of one call


class MaskMismatch(AssertionError):
  def __init__(self, message: str, errors: list[OutputError]):
    self.errors = errors
    super().__init__(message)


def _xp():
  """numpy on a CPU backend (the ci profile's many small shapes would each pay
  an XLA compile), jax.numpy under jit where the long ones run: there the
  check's elementwise work over [rows, T, H, D] outputs stays on the device
  and only counts come back (docs/VERIFICATION.md, "Where a case's seconds go")."""
  return np if jax.default_backend() == "cpu" else jnp


def _one_hot(xp, positions, batch, t, heads, dtype, scale=1.0):
  """[R * batch, t, heads, D]: row r's position positions[r, e] one-hot at e
  (scale there), every other element zero; positions past t select nothing."""
  rows, d = positions.shape
  hit = xp.arange(t)[None, None, :, None, None] == positions[:, None, None, None, :]
  x = xp.broadcast_to(hit, (rows, batch, t, heads, d)).astype(dtype) * xp.asarray(scale, dtype)
  return x.reshape(rows * batch, t, heads, d)


def _positions(xp, chunks, d):
  """[R, D]: the key (and query) positions of each row's chunk."""
  return xp.asarray(chunks)[:, None] * d + xp.arange(d)[None, :]


def _chunk_inputs(xp, case: Case, chunks, base: dict, with_lse: bool) -> dict:
  b, tq, tk, hq, hkv, d = (case.batch, case.seq_len, case.tk, case.num_q_heads,
                           case.num_kv_heads, case.head_dim)
  dtype = DTYPES[case.dtype]
  rows = len(chunks)
  positions = _positions(xp, np.asarray(chunks), d)
  temp = base["temperature"]
  if temp is not None:
    temp = np.ones_like(np.asarray(temp, np.float32))
    if temp.ndim == 3:
      temp = np.tile(temp, (rows, 1, 1))
  tiled = lambda x: None if x is None else np.tile(x, (rows, 1))
  k = _one_hot(xp, positions, b, tk, hkv, dtype)
  dlse = np.full((rows * b, hq, tq), LSE_COTANGENT if with_lse else 0.0, np.float32)
  return {"q": _one_hot(xp, positions, b, tq, hq, dtype, QUERY_SCALE), "k": k, "v": k,
          "segment_ids": tiled(base["segment_ids"]), "temperature": temp,
          "kv_segment_ids": tiled(base["kv_segment_ids"]), "sinks": None,
          "dout": _one_hot(xp, positions, b, tq, hq, dtype), "dlse": dlse}


def _expected(xp, case: Case, seg, chunks):
  """(query-major [R, B or 1, Tq, 1, D], key-major [R, B or 1, Tk, 1, D])
  visible sets of each row's chunk: [r, b, i, 0, e] is whether query i sees
  key chunks[r]*D + e (False past Tk), and whether query chunks[r]*D + e
  (False past Tq) sees key i. ``seg``: (the queries' ids, the keys')."""
  tq, tk, d = case.seq_len, case.tk, case.head_dim
  positions = _positions(xp, chunks, d)
  rows = positions.shape[0]
  mask = lambda **kw: xp.asarray(visible_keys(
      tq, seg[0], case.causal, case.window_len, kv_seq_len=tk, kv_segment_ids=seg[1],
      q_offset=case.offset, **kw))
  by_query = mask(keys=xp.minimum(positions, tk - 1).reshape(-1))  # [B', Tq, R*D]
  by_key = mask(queries=xp.minimum(positions, tq - 1).reshape(-1))  # [B', R*D, Tk]
  lead = by_query.shape[0]
  by_query = xp.transpose(by_query.reshape(lead, tq, rows, d), (2, 0, 1, 3))
  by_key = xp.transpose(by_key.reshape(lead, rows, d, tk), (1, 0, 3, 2))
  valid = lambda t: (positions < t)[:, None, None, None, :]
  return by_query[:, :, :, None, :] & valid(tk), by_key[:, :, :, None, :] & valid(tq)


def _counts(xp, case: Case, layouts: tuple, seg, chunks, kept, *outputs):
  """Per output: (hidden keys seen, visible ones dropped, NaN, flat index of
  the first mismatch in [R, B, T, H, D]), over the first ``kept`` rows of one
  call (the others repeat its last chunk)."""
  by_query, by_key = _expected(xp, case, seg, chunks)
  rows = chunks.shape[0]
  live = (xp.arange(rows) < kept)[:, None, None, None, None]
  counts = []
  for x, key_major in zip(outputs, layouts):
    x = x.reshape(rows, case.batch, *x.shape[1:])
    got, expected = x != 0, by_key if key_major else by_query
    leaked, dropped = got & ~expected & live, ~got & expected & live
    counts.append((xp.sum(leaked), xp.sum(dropped), xp.sum(xp.isnan(x) & live),
                   xp.argmax((leaked | dropped).reshape(-1))))
  return counts


@functools.lru_cache(maxsize=32)
def _jitted_counts(case: Case, layouts: tuple):
  return jax.jit(functools.partial(_counts, jnp, case, layouts))


def _count_fn(case: Case, layouts: tuple):
  if _xp() is np:
    return functools.partial(_counts, np, case, layouts)
  return _jitted_counts(dataclasses.replace(case, seed=0), layouts)


def _gradients_encode_the_mask(case: Case) -> bool:
  """Whether cap' is nonzero at the two scores the inputs give (0, and
  sm_scale * QUERY_SCALE on the diagonal): a user's cap flat there would zero
  dq and dk legitimately."""
  if case.cap_method == "none":
    return True
  sm = case.sm_scale if case.sm_scale is not None else case.head_dim ** -0.5
  grad = CAP_METHODS[case.cap_method].grad
  return all(float(grad(np.float32(x), *case.cap_params)) != 0.0 for x in (0.0, sm * QUERY_SCALE))


@dataclasses.dataclass
class _Tally:
  """Mismatched (batch row, head, query, key) elements of one output, and the
  first one seen."""
  name: str
  leaked: int = 0
  dropped: int = 0
  nan: int = 0
  first: tuple = ()

  def add(self, counts, shape, chunks, d, key_major):
    """``counts`` of _counts for this output, over outputs of ``shape``
    [R, B, T, H, D]."""
    leaked, dropped, nan, first = (int(c) for c in counts)
    self.leaked += leaked
    self.dropped += dropped
    self.nan += nan
    if not self.first and (leaked or dropped):
      r, b, i, h, e = (int(x) for x in np.unravel_index(first, shape))
      chunk = int(chunks[r])
      query, key = (chunk * d + e, i) if key_major else (i, chunk * d + e)
      self.first = (b, h, query, key)

  def error(self) -> OutputError:
    bad = self.leaked + self.dropped
    return OutputError(f"{self.name} (visible set)", float(bad), 0.0, 0.0, self.nan, 0,
                       self.first)

  def describe(self) -> str:
    text = (f"{self.name}: {self.leaked} hidden keys seen, {self.dropped} visible ones "
            f"dropped (over rows and heads), {self.nan} NaN")
    if self.first:
      b, h, query, key = self.first
      text += f"; first: batch {b}, head {h}, query {query}, key {key}"
    return text


def mask_is_exact(impl, case: Case):
  """Every query of the forward, the dq product and the dk/dv product sees
  exactly the keys ``visible_keys`` says (see the module doc)."""
  with_lse = "lse" not in impl.unsupported
  check_grads = with_lse and _gradients_encode_the_mask(case)
  t, d = max(case.seq_len, case.tk), case.head_dim
  chunks = -(-t // d)
  per_call = max(1, min(chunks, ELEMENT_BUDGET // (case.batch * t * case.num_q_heads * d)))
  call_case = dataclasses.replace(case, batch=case.batch * per_call, return_lse=with_lse)
  base = make_inputs(case)
  names = [("out", False), ("dv", True)] + ([("dq", False), ("dk", True)] if check_grads else [])
  tallies = {name: _Tally(name) for name, _ in names}
  xp = _xp()
  layouts = tuple(key_major for _, key_major in names)
  count = _count_fn(case, layouts)
  seg = tuple(None if base[n] is None else xp.asarray(base[n])
              for n in ("segment_ids", "kv_segment_ids"))
  for first in range(0, chunks, per_call):
    # A last call's spare rows repeat its last chunk; only the first ``kept`` count.
    group = np.array([min(c, chunks - 1) for c in range(first, first + per_call)])
    result = evaluate_arrays(impl, call_case, _chunk_inputs(xp, case, group, base, with_lse))
    outputs = [xp.asarray(result[name]) for name, _ in names]
    kept = min(per_call, chunks - first)
    for (name, key_major), counts, x in zip(
        names, count(seg, xp.asarray(group), kept, *outputs), outputs):
      shape = (per_call, case.batch) + tuple(x.shape[1:])
      tallies[name].add(counts, shape, group, d, key_major)
  errors = [tally.error() for tally in tallies.values()]
  bad = [tally for tally in tallies.values() if tally.leaked or tally.dropped or tally.nan]
  if bad:
    raise MaskMismatch("the visible set differs from the contract's:\n"
                       + "\n".join(tally.describe() for tally in bad), errors)
  return errors
