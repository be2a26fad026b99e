"""Context-parallel attention: one sequence sharded over the devices of a mesh axis.

Each of the P devices holds T/P queries, keys and values. The key/value shards travel
around a ring (``lax.ppermute`` under ``shard_map``), each device attends its queries to
the shard it holds with this package's kernels, and the partial outputs merge through
their log-sum-exp. The backward is jax's transpose of the same ring: dK and dV travel
back with their shard; nothing is atomic, so gradients are deterministic.

Causal attention uses the zig-zag layout: the sequence is cut in 2P chunks and device d
holds chunks d and 2P - 1 - d, so every device does the same causal work. A (query
chunk, key chunk) pair is then fully visible (the key chunk is earlier), the diagonal
(a causal call) or hidden (skipped: no kernel runs). The cost model is in
docs/CONTEXT_PARALLEL.md.

Windows and segment ids take the kernels' key blocks (attention.attention_block): a
window that crosses a shard boundary sees keys of another shard at their own positions,
and a document that spans shards is matched by the keys' own segment ids, which travel
around the ring with their shard. Those pairs run on the Triton kernels (without segment
ids, the Mosaic forward where the config asks for it; docs/SEMANTICS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from ua_reference.contract import validate, with_z_loss_gradient

from .attention import SUPPORTED_DTYPES, attention as _attention, attention_block
from .kernel_config import KernelConfig


def attention(q, k, v, *, mesh: Mesh, axis: str, segment_ids=None, causal=False,
              window_len=0, cap_method="none", cap_params=(), temperature=None,
              sm_scale=None, z_loss_weight=0.0, return_lse=False,
              config: KernelConfig | None = None):
  """The contract's attention (docs/SEMANTICS.md) with T sharded over ``mesh``'s
  ``axis``: global q, k, v [B, T, H, D] in, global out (and lse) out. Over more
  than one device T must be a multiple of twice the axis size (the zig-zag
  chunks); over one it is the plain call."""
  spec, segment_ids, temperature = validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, z_loss_weight=z_loss_weight, return_lse=return_lse)
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis not in mesh.shape:
    raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
  shards = mesh.shape[axis]
  if shards == 1:
    # The whole sequence on one device: the plain call (one kernel, no ring
    # steps to merge, no zig-zag gathers), whose cost the op must not exceed.
    return _attention(q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
                      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
                      sm_scale=spec.sm_scale, z_loss_weight=z_loss_weight,
                      return_lse=return_lse, config=config)
  t = q.shape[1]
  if t % (2 * shards):
    raise ValueError(f"the sequence length ({t}) must be a multiple of twice the number of "
                     f"shards along {axis!r} ({2 * shards}): the zig-zag layout cuts it in "
                     f"{2 * shards} equal chunks")
  return _ring_attention(q, k, v, mesh=mesh, axis=axis, spec=spec, segment_ids=segment_ids,
                         causal=causal, cap_method=cap_method, cap_params=cap_params,
                         temperature=temperature, z_loss_weight=z_loss_weight,
                         return_lse=return_lse, config=config)


def _ring_attention(q, k, v, *, mesh, axis, spec, segment_ids, causal, cap_method, cap_params,
                    temperature, z_loss_weight, return_lse, config):
  """The ring over ``mesh``'s ``axis`` in the zig-zag layout, for validated
  inputs (``spec``: the contract's validated options); any shard count, one
  included (benchmarks/context_parallel.py times that against the plain call)."""
  shards, t = mesh.shape[axis], q.shape[1]
  window = spec.window_len if spec.window_len < t else 0  # validate clamps it to T
  common = dict(cap_method=cap_method, cap_params=tuple(cap_params), sm_scale=spec.sm_scale,
                config=config)
  plain = functools.partial(_attention, return_lse=True, **common)
  block = functools.partial(attention_block, causal=causal, window_len=window, **common)
  ring = functools.partial(_ring, plain=plain, block=block, axis=axis, shards=shards,
                           causal=causal, by_block=bool(window) or segment_ids is not None,
                           z_loss_weight=float(z_loss_weight), out_dtype=q.dtype)
  seq = PartitionSpec(None, axis)
  extras = {name: x for name, x in (("temperature", temperature), ("segment_ids", segment_ids))
            if x is not None}
  in_specs = (seq, seq, seq, {name: seq for name in extras})
  out_specs = (seq, PartitionSpec(None, None, axis))
  zig = lambda x: _zigzag(x, shards)
  sharded = _shard_map(ring, mesh, in_specs, out_specs)
  out, lse = sharded(zig(q), zig(k), zig(v), {name: zig(x) for name, x in extras.items()})
  out, lse = _unzigzag(out, shards), _unzigzag(lse, shards, axis=2)
  return (out, lse) if return_lse else out


def _shard_map(f, mesh, in_specs, out_specs):
  """jax.shard_map without its replication check (a pallas_call has no rule for it);
  the keyword is check_vma in newer jax, check_rep in older."""
  params = inspect.signature(jax.shard_map).parameters
  check = {"check_vma": False} if "check_vma" in params else {"check_rep": False}
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)


def _zigzag_order(shards: int) -> list[int]:
  """Chunk order of the zig-zag layout: device d's two chunks d, 2P-1-d, in turn."""
  return [c for d in range(shards) for c in (d, 2 * shards - 1 - d)]


def _zigzag(x, shards: int, axis: int = 1):
  chunks = jnp.split(x, 2 * shards, axis=axis)
  return jnp.concatenate([chunks[c] for c in _zigzag_order(shards)], axis=axis)


def _unzigzag(x, shards: int, axis: int = 1):
  chunks = jnp.split(x, 2 * shards, axis=axis)
  where = {c: i for i, c in enumerate(_zigzag_order(shards))}
  return jnp.concatenate([chunks[where[c]] for c in range(2 * shards)], axis=axis)


def _ring(q, k, v, extras, *, plain, block, axis, shards, causal, by_block, z_loss_weight,
          out_dtype):
  """One device's part: its two query chunks against every key chunk of the ring.
  ``extras``: the local temperature and segment ids, where given. Each step sends
  the shard it holds on to the next device while it attends to it, so the
  transfer overlaps the kernels. The first step (the device's own keys) and the
  last (which sends nothing) are written out and the ones between are one
  ``lax.scan`` body: the program holds the kernels of three steps whatever the
  shard count."""
  local = _Local(device=lax.axis_index(axis), shards=shards, half=q.shape[1] // 2, q=q,
                 temperature=extras.get("temperature"), seg=extras.get("segment_ids"))
  step = functools.partial(_ring_step, local, plain=plain, block=block, causal=causal,
                           by_block=by_block)
  perm = [(d, (d + 1) % shards) for d in range(shards)]
  send_on = lambda kv: tuple(None if x is None else lax.ppermute(x, axis, perm) for x in kv)
  kv = (k, v, local.seg)  # the keys' segment ids travel with their shard
  if shards == 1:
    partial = step(kv, None, 0)
  else:
    kv, partial = send_on(kv), step(kv, None, 0)

    def middle_step(carry, step_index):
      kv, partial = carry
      return (send_on(kv), step(kv, partial, step_index)), None

    if shards > 2:
      (kv, partial), _ = lax.scan(middle_step, (kv, partial), jnp.arange(1, shards - 1))
    partial = step(kv, partial, shards - 1)
  outs, lses = zip(*(_finish(o, lse, z_loss_weight, out_dtype) for o, lse in partial))
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


@dataclasses.dataclass(frozen=True)
class _Local:
  """What a device holds of its own: its index, its two query chunks (global
  chunks ``device`` and ``2 shards - 1 - device``, ``half`` rows each) and their
  temperature and segment ids."""

  device: jax.Array
  shards: int
  half: int
  q: jax.Array
  temperature: jax.Array | None
  seg: jax.Array | None

  def chunk(self, x, i, axis=1):
    return None if x is None else lax.slice_in_dim(x, i * self.half, (i + 1) * self.half,
                                                   axis=axis)

  def own(self, i):
    return self.device if i == 0 else 2 * self.shards - 1 - self.device


def _ring_step(local, kv, partial, step, *, plain, block, causal, by_block):
  """Both query chunks against the key chunks held at ``step`` (the shard of
  device - step), merged into ``partial`` (None before the first step). Which
  pairs are hidden, diagonal or full is known here from ``step == 0`` alone,
  except which of (chunk 0, keys' chunk 0) and (chunk 1, keys' chunk 1) is full
  at a later step: one kernel runs on the pair selected (``_either``)."""
  k, v, _ = kv
  first = isinstance(step, int) and step == 0
  source = (local.device - step) % local.shards  # whose keys this device holds
  k_ids = (source, 2 * local.shards - 1 - source)
  run = functools.partial(_run_pair, local, kv, k_ids, plain=plain, block=block,
                          by_block=by_block)
  if not causal and not by_block:
    # Every pair full: one call of both query chunks against both key chunks.
    out, lse = _call(plain, local.q, k, v, local.temperature, causal=False)
    parts = [((local.chunk(out, i), local.chunk(lse, i, axis=2)),) for i in range(2)]
  elif not causal:
    parts = [tuple(run(i, j) for j in range(2)) for i in range(2)]
  elif first:
    # Own keys: chunk 0 sees its diagonal only, chunk 1 all of chunk 0 and its diagonal.
    parts = [(run(0, 0, diagonal=True),), (run(1, 0), run(1, 1, diagonal=True))]
  else:
    # Chunk 1 (from the back half) sees all of the early key chunk and chunk 0 none of
    # the late one; of the other two pairs exactly one is full: chunk 0's if the
    # keys' early chunk lies before it, else chunk 1's.
    either = _either(source < local.device, run)
    parts = [(either[0],), (run(1, 0), either[1])]
  merged = []
  for i in range(2):
    acc = None if partial is None else partial[i]
    for part in parts[i]:
      acc = part if acc is None else _merge(acc, part)
    merged.append(acc)
  return tuple(merged)


def _run_pair(local, kv, k_ids, i, j, *, plain, block, by_block, diagonal=False, pick=None):
  """(out float32, lse) of query chunk i against key chunk j. ``pick``: a
  traced bool choosing the pair (0, 0) where true and (1, 1) where false (i and
  j are then ignored). ``diagonal`` picks the kernels' causal call; a key block
  needs no such flag (``block`` has the op's ``causal`` bound and the offset says
  where the pair lies)."""
  k, v, kv_seg = kv
  chunk = local.chunk
  if pick is None:
    qi, ti, si = chunk(local.q, i), chunk(local.temperature, i), chunk(local.seg, i)
    kj, vj, kvj = chunk(k, j), chunk(v, j), chunk(kv_seg, j)
    own, k_id = local.own(i), k_ids[j]
  else:
    sel = lambda a, b: None if a is None else jnp.where(pick, a, b)
    both = lambda x: sel(chunk(x, 0), chunk(x, 1))
    qi, ti, si = both(local.q), both(local.temperature), both(local.seg)
    kj, vj, kvj = both(k), both(v), both(kv_seg)
    own, k_id = sel(local.own(0), local.own(1)), sel(k_ids[0], k_ids[1])
  if by_block:
    out, lse = block(qi, kj, vj, temperature=ti, segment_ids=si, kv_segment_ids=kvj,
                     offset=(own - k_id) * local.half)
    return out.astype(jnp.float32), lse
  return _call(plain, qi, kj, vj, ti, causal=diagonal)


def _either(pick, run):
  """The two parts of the pair selected by ``pick`` (see _run_pair): the one
  that ran where it was selected, an empty part (out 0, lse -inf: nothing to
  merge) where not."""
  out, lse = run(None, None, pick=pick)
  empty = lambda keep: (jnp.where(keep, out, 0.0), jnp.where(keep, lse, -jnp.inf))
  return empty(pick), empty(jnp.logical_not(pick))


def _call(plain, q, k, v, temperature, *, causal):
  out, lse = plain(q, k, v, temperature=temperature, causal=causal)
  return out.astype(jnp.float32), lse


def _merge(a, b):
  """Two parts of the same query rows, merged through their lse (rows where
  both are empty stay empty: out 0, lse -inf, and no NaN in the gradient)."""
  (out_a, lse_a), (out_b, lse_b) = a, b
  top = jnp.maximum(lse_a, lse_b)
  empty = top == -jnp.inf
  top = jnp.where(empty, 0.0, top)
  w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
  total = w_a + w_b
  safe = jnp.where(empty, 1.0, total)
  lse = jnp.where(empty, -jnp.inf, top + jnp.log(safe))
  rows = lambda w: jnp.transpose(w / safe, (0, 2, 1))[..., None]
  return out_a * rows(w_a) + out_b * rows(w_b), lse


def _finish(out, lse, z_loss_weight, out_dtype):
  """The merged rows with the z-loss on their lse: the lse passes through an
  identity whose backward adds w * lse (the contract's z-loss gradient), and the
  output is rescaled by exp(lse - that identity), 1 in value, so that the
  injected gradient reaches the output's path as it does in the reference."""
  if z_loss_weight:
    with_z = with_z_loss_gradient(lse, z_loss_weight)
    safe = lambda x: jnp.where(jnp.isfinite(lse), x, 0.0)
    out = out * jnp.transpose(jnp.exp(safe(lse) - safe(with_z)), (0, 2, 1))[..., None]
    lse = with_z
  return out.astype(out_dtype), lse


def _on_devices(shards: int):
  """``attention`` on the first ``shards`` devices, as an implementation the
  suite can load (``--impl ua_kernels.context_parallel:on_2_devices``): one mesh
  axis over them, with its declarations. On the CPU, start jax with that many
  devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``."""
  def sharded(q, k, v, **kwargs):
    devices = jax.devices()
    if len(devices) < shards:
      raise RuntimeError(f"{shards} devices needed, {len(devices)} present (on the CPU: "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={shards})")
    mesh = Mesh(np.array(devices[:shards]), ("context",))
    return attention(q, k, v, mesh=mesh, axis="context", **kwargs)

  sharded.__name__ = sharded.__qualname__ = f"on_{shards}_devices"
  sharded.ua_seq_len_multiple = 2 * shards
  # The kernels' smallest tile: the suite draws lengths and windows around its
  # edges (a window then crosses the T / 2P chunks' boundaries at several places).
  sharded.ua_block_sizes = (16,)
  sharded.ua_dtypes = tuple(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
  sharded.ua_unsharded = "ua_kernels:attention"  # checked against it, case by case
  # One sequence sharded along its length: queries and keys of one length, no sinks.
  sharded.ua_unsupported = ("kv_length", "q_offset", "kv_segment_ids", "sinks")
  return sharded


on_2_devices = _on_devices(2)
on_4_devices = _on_devices(4)
