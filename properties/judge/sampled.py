"""The oracle on sampled query rows: at lengths where a dense float64 oracle
costs O(T^2 D) per head, it evaluates the reference on a few blocks of query
rows (inputs.sampled_rows) against every key, each block a call of its own at
its place among the keys (q_offset), so its cost is O(rows x Tk x D).

The case's cotangents are nonzero on those rows alone (inputs.make_inputs): the
rows' contributions, summed, are then every key's whole dk and dv, and the
sinks' whole gradient, without a z-loss. A z-loss gives every row an lse
cotangent, so there dk, dv and d sinks are left unjudged (None), and only the
sampled rows' out, lse and dq are (docs/SCALE.md, "Sampled rows").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model.case import Case
from ..model.inputs import sample_blocks
from .tolerance import OutputError

ROW_OUTPUTS = ("out", "dq")  # [B, Tq, Hq, D]: judged at the sampled rows; lse [B, Hq, Tq] too
KEY_OUTPUTS = ("dk", "dv", "dsinks")  # summed over the blocks


def block_call(case: Case, inputs: dict, start: int, stop: int) -> tuple[Case, dict]:
  """The case and inputs of query rows [start, stop) alone: the same keys, the
  rows at their own place among them (q_offset), the keys' segment ids passed
  explicitly (the queries' own, where the case has no separate ones)."""
  block = dataclasses.replace(case, seq_len=stop - start, kv_seq_len=case.tk,
                              q_offset=case.offset + start, sampled_rows=0)
  rows = slice(start, stop)
  seg = inputs["segment_ids"]
  kv_seg = inputs.get("kv_segment_ids")
  temp = inputs["temperature"]
  out = dict(inputs)
  out.update(q=inputs["q"][:, rows], dout=inputs["dout"][:, rows],
             dlse=inputs["dlse"][..., rows],
             segment_ids=None if seg is None else seg[:, rows],
             kv_segment_ids=kv_seg if kv_seg is not None or seg is None else seg,
             temperature=temp[:, rows] if np.ndim(temp) == 3 else temp)
  return block, out


def evaluate_rows(case: Case, inputs: dict, reference) -> tuple[dict, np.ndarray]:
  """(outputs, lse) of ``reference(case, inputs)`` -> (outputs, lse) on the
  case's sampled rows, block by block (inputs.sample_blocks): out, lse and dq
  of those rows, dk, dv and d sinks summed over them (None under a z-loss)."""
  parts = [reference(*block_call(case, inputs, a, b)) for a, b in sample_blocks(case)]
  results = [r for r, _ in parts]
  lse = np.concatenate([lse for _, lse in parts], axis=2)
  out = {name: np.concatenate([r[name] for r in results], axis=1) for name in ROW_OUTPUTS}
  out["lse"] = lse if case.return_lse else None
  for name in KEY_OUTPUTS:
    present = results[0].get(name) is not None and not case.z_loss_weight
    out[name] = sum(r[name] for r in results) if present else None
  return out, lse


def judged(case: Case, rows: np.ndarray, result: dict) -> dict:
  """``result`` (an implementation's, every row) at the judged rows; outputs
  already of the judged rows' shape are left as they are."""
  out = dict(result)
  t = case.seq_len
  for name in ROW_OUTPUTS:
    x = result.get(name)
    if x is not None and np.shape(x)[1] == t:
      out[name] = np.asarray(x)[:, rows]
  x = result.get("lse")
  if x is not None and np.shape(x)[-1] == t:
    out["lse"] = np.asarray(x)[..., rows]
  return out


def other_rows_dq(case: Case, dq) -> list[OutputError]:
  """[the error "dq (other rows)"] over the rows not sampled, whose cotangents
  are zero: their dq is exactly 0 in any evaluation order (ds = p (dp - delta)
  with dp and delta both 0), so its tolerance is 0. [] under a z-loss, which
  gives them an lse cotangent. Read in slices of OTHER_ROWS_CHUNK rows: at
  T = 256k a float64 copy of them is 17 GB."""
  if case.z_loss_weight or dq is None:
    return []
  dq = np.asarray(dq)
  largest, nans, infs, worst = 0.0, 0, 0, (0, 0) + (0,) * (dq.ndim - 2)
  for start, stop in _other_runs(case):
    for a in range(start, stop, OTHER_ROWS_CHUNK):
      x = dq[:, a:min(stop, a + OTHER_ROWS_CHUNK)].astype(np.float32)
      nans, infs = nans + int(np.isnan(x).sum()), infs + int(np.isinf(x).sum())
      magnitude = np.where(np.isfinite(x), np.abs(x), 0.0)
      at = np.unravel_index(int(np.argmax(magnitude)), magnitude.shape)
      if float(magnitude[at]) > largest:
        largest, worst = float(magnitude[at]), (int(at[0]), a + int(at[1])) + tuple(
            int(i) for i in at[2:])
  return [OutputError("dq (other rows)", largest, 0.0, 0.0, nans, infs, worst, error=largest)]


OTHER_ROWS_CHUNK = 4096


def _other_runs(case: Case) -> list[tuple[int, int]]:
  """[start, stop) of the runs of rows between the sampled blocks."""
  edges = [0] + [e for block in sample_blocks(case) for e in block] + [case.seq_len]
  return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
