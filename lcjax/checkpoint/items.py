"""Reading many orbax items (the stored parts of lcjax.checkpoint.layout) concurrently, in one event loop.

Each part is an orbax PyTree checkpoint {"value": array} of its own directory. `PyTreeCheckpointer.restore` reads
one such directory a call and pays ~10-20 ms of fixed cost each time (an event loop, its threads, metadata reads,
a barrier), which is most of a small model's load. Here each part is read by the type handler that restore uses
for a jax.Array (`ocp.type_handlers.get_type_handler(jax.Array)`: its `deserialize`, one call per directory as
its ParamInfo contract asks), all the calls of a batch gathered in one event loop: the reads overlap and the fixed
cost is paid once a batch. How a part is read (OCDBT or not, zarr3 or not, whether missing chunks are an error)
is taken from its own tree metadata file, with orbax's defaults for a key it lacks. There is no barrier between
processes (Checkpointer.restore has one a call): each process reads only its devices' shards, and what uses the
parts (lcjax.checkpoint.restore) runs the same programs in the same order on every process. A read that fails on
one process raises there only: the others go on to the next batch's programs and wait in them for it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from lcjax.checkpoint.layout import CheckpointError, read_json

TREE_METADATA_FILE = "_METADATA"       # orbax's PyTree metadata of an item directory


class Part(NamedTuple):
  """One stored part to read: its item directory, what to call it in errors, and the array it is read as."""
  path: str
  where: str                              # "tensor layers/attn/wq layer 3 part 1"
  shape: tuple[int, ...]
  dtype: Any
  sharding: jax.sharding.Sharding

  @property
  def nbytes(self) -> int:
    """Bytes of the array as read (its shape in its read dtype)."""
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def read_parts(ckpt_dir: str, parts: list[Part]) -> list[jax.Array]:
  """The arrays of `parts`, in order, each read with its own global shape, dtype and sharding (a process reads only
  its devices' shards). All of them are read concurrently: the caller bounds a batch's bytes. A part that cannot
  be read raises a CheckpointError naming ckpt_dir and the part, after every read of the batch has ended."""
  if not parts:
    return []
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    results = _run(_gather(ckpt_dir, parts))
  else:   # called from a coroutine, as a notebook kernel runs a cell: its loop cannot run another; a thread can
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      results = pool.submit(_run, _gather(ckpt_dir, parts)).result()
  for r in results:
    if isinstance(r, BaseException):
      raise r
  return results


def _run(coro):
  """coro run to its end in a new event loop of this thread (asyncio.run's teardown is not thread-safe: it walks
  asyncio's global set of tasks, which another thread's loop may change)."""
  loop = asyncio.new_event_loop()
  try:
    return loop.run_until_complete(coro)
  finally:
    loop.close()


def _param_info(part: Part, contexts: dict) -> ocp.type_handlers.ParamInfo:
  meta = read_json(os.path.join(part.path, TREE_METADATA_FILE))
  tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
  if not isinstance(tree, dict) or len(tree) != 1:       # an lcjax item is {"value": array}
    got = f"{len(tree)} leaves" if isinstance(tree, dict) else f"no tree metadata ({type(tree).__name__})"
    raise CheckpointError(f"its {TREE_METADATA_FILE} holds {got}, not the one leaf 'value'")
  use_ocdbt = meta.get("use_ocdbt")
  if use_ocdbt is None:
    use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(epath.Path(part.path))
  if use_ocdbt not in contexts:
    contexts[use_ocdbt] = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  return ocp.type_handlers.ParamInfo(
      name="value", parent_dir=epath.Path(part.path), is_ocdbt_checkpoint=use_ocdbt,
      use_zarr3=meta.get("use_zarr3", False), ts_context=contexts[use_ocdbt],
      raise_array_data_missing_error=meta.get("store_array_data_equal_to_fill_value", False))


async def _gather(ckpt_dir: str, parts: list[Part]) -> list:
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  contexts: dict[bool, Any] = {}     # one TensorStore context a batch (its OCDBT node cache is shared)

  async def read(part: Part):
    try:
      info = _param_info(part, contexts)
      args = ocp.ArrayRestoreArgs(sharding=part.sharding, global_shape=tuple(part.shape), dtype=part.dtype)
      (value,) = await handler.deserialize([info], [args])
    except Exception as e:  # orbax/tensorstore raise many types for missing or truncated chunks
      # tensorstore appends its whole JSON spec; the first clause says what went wrong.
      msg = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0][:400]
      kind = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "
      raise CheckpointError(f"{ckpt_dir}: cannot read {part.where}: {kind}{msg}") from e
    if tuple(value.shape) != tuple(part.shape):
      raise CheckpointError(f"{ckpt_dir}: {part.where} has shape {tuple(value.shape)}, expected {tuple(part.shape)}")
    return value

  return await asyncio.gather(*(read(p) for p in parts), return_exceptions=True)
