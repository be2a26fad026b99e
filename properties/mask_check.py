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

import numpy as np

from ua_reference import visible_keys
from ua_reference.caps import CAP_METHODS

from .case import Case
from .inputs import DTYPES, make_inputs
from .runner import evaluate
from .tolerance import OutputError

QUERY_SCALE = 2.0 ** -3  # keeps sm_scale * QUERY_SCALE below every drawn cap (>= sm_scale / 4 * sqrt(D))
LSE_COTANGENT = 1024.0  # makes float16 dk of T = 16k rows (about 1e-4) a normal number
ELEMENT_BUDGET = 1 << 25  # elements of one [B, T, Hq, D] input of one call


class MaskMismatch(AssertionError):
  def __init__(self, message: str, errors: list[OutputError]):
    self.errors = errors
    super().__init__(message)


def _one_hot(chunks, batch, t, heads, d, dtype, scale=1.0):
  """[len(chunks) * batch, t, heads, d]: row r's positions of chunk c =
  chunks[r] one-hot at their offset in the chunk, other positions zero."""
  x = np.zeros((len(chunks) * batch, t, heads, d), dtype)
  for r, c in enumerate(chunks):
    pos = np.arange(c * d, min((c + 1) * d, t))
    for b in range(batch):
      x[r * batch + b, pos, :, pos - c * d] = scale
  return x


def _chunk_inputs(case: Case, chunks, base: dict, with_lse: bool) -> dict:
  b, t, hq, hkv, d = (case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads,
                      case.head_dim)
  dtype = DTYPES[case.dtype]
  rows = len(chunks)
  temp = base["temperature"]
  if temp is not None:
    temp = np.ones_like(np.asarray(temp, np.float32))
    if temp.ndim == 3:
      temp = np.tile(temp, (rows, 1, 1))
  seg = None if base["segment_ids"] is None else np.tile(base["segment_ids"], (rows, 1))
  k = _one_hot(chunks, b, t, hkv, d, dtype)
  dlse = np.full((rows * b, hq, t), LSE_COTANGENT if with_lse else 0.0, np.float32)
  return {"q": _one_hot(chunks, b, t, hq, d, dtype, QUERY_SCALE), "k": k, "v": k,
          "segment_ids": seg, "temperature": temp,
          "dout": _one_hot(chunks, b, t, hq, d, dtype), "dlse": dlse}


def _expected(case: Case, seg, chunk: int):
  """(query-major, key-major) [B or 1, T, 1, D] visible sets of key chunk
  ``chunk``: [b, i, e] is whether query i sees key chunk*D + e, and whether
  query chunk*D + e sees key i; False past T."""
  t, d = case.seq_len, case.head_dim
  pos = np.arange(chunk * d, min((chunk + 1) * d, t))
  args = (t, seg, case.causal, case.window_len)
  by_query = np.asarray(visible_keys(*args, keys=pos))
  by_key = np.swapaxes(np.asarray(visible_keys(*args, queries=pos)), 1, 2)
  pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, d - len(pos))))[:, :, None, :]
  return pad(by_query), pad(by_key)


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

  def add(self, got_raw, expected, chunk, d, key_major):
    got_raw = np.asarray(got_raw, np.float32)
    got = got_raw != 0
    self.nan += int(np.isnan(got_raw).sum())
    leaked, dropped = got & ~expected, ~got & expected
    self.leaked += int(leaked.sum())
    self.dropped += int(dropped.sum())
    if not self.first and (leaked.any() or dropped.any()):
      b, i, h, e = (int(x) for x in np.argwhere(leaked | dropped)[0])
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
  t, d = case.seq_len, case.head_dim
  chunks = -(-t // d)
  per_call = max(1, min(chunks, ELEMENT_BUDGET // (case.batch * t * case.num_q_heads * d)))
  call_case = dataclasses.replace(case, batch=case.batch * per_call, return_lse=with_lse)
  base = make_inputs(case)
  names = [("out", False), ("dv", True)] + ([("dq", False), ("dk", True)] if check_grads else [])
  tallies = {name: _Tally(name) for name, _ in names}
  for first in range(0, chunks, per_call):
    group = [min(c, chunks - 1) for c in range(first, first + per_call)]
    result = evaluate(impl, call_case, _chunk_inputs(case, group, base, with_lse))
    for r, chunk in enumerate(group[:chunks - first]):
      by_query, by_key = _expected(case, base["segment_ids"], chunk)
      rows = slice(r * case.batch, (r + 1) * case.batch)
      for name, key_major in names:
        tallies[name].add(result[name][rows], by_key if key_major else by_query, chunk, d,
                          key_major)
  errors = [tally.error() for tally in tallies.values()]
  bad = [tally for tally in tallies.values() if tally.leaked or tally.dropped or tally.nan]
  if bad:
    raise MaskMismatch("the visible set differs from the contract's:\n"
                       + "\n".join(tally.describe() for tally in bad), errors)
  return errors
