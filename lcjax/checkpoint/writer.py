"""Writing a checkpoint (the format of lcjax.checkpoint.layout), atomically.

Everything goes to `DST.tmp-<pid>-<token>` (a name of this writer's own) and is renamed to DST only after the
manifest is written (lcjax.checkpoint.atomic), so an interrupted conversion leaves nothing that looks like a
checkpoint; the leftovers of dead processes are removed by the next run.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from lcjax.checkpoint import layout
from lcjax.checkpoint.atomic import AtomicDirectory
from lcjax.checkpoint.layout import (CONFIG_FILE, FORMAT, MANIFEST_FILE, PARAMS_DIR, CheckpointError, item_dir,
                                     param_shapes, part_rows)
from lcjax.config import ModelConfig, WeightFormat


class CheckpointWriter:
  """Writes a checkpoint tensor by tensor into `DST.tmp-<pid>-<token>`, renamed to DST on a clean exit.

    with CheckpointWriter(dst, cfg) as w:
      w.write("embed/embedding", array)            # unstacked tensor, full shape
      w.write("layers/attn/wq", array, layer=3)    # one layer of a stacked tensor, shape without L
      w.copy_file(path)                            # tokenizer files etc.
  """

  def __init__(self, dst: str, cfg: ModelConfig, *, weights: WeightFormat = WeightFormat(), overwrite: bool = False,
               source: str = ""):
    self.dst = os.path.abspath(dst)
    self.cfg = cfg
    self.overwrite = overwrite
    self.source = source
    self._dir = AtomicDirectory(self.dst, MANIFEST_FILE, overwrite=overwrite, exists_error=CheckpointError(
        f"{self.dst} already exists; pass --overwrite to replace it"), error=CheckpointError,
        what="lcjax checkpoint")
    self.tmp = self._dir.tmp                        # where the writes below go
    self.expected = param_shapes(cfg, weights)
    self.written: dict[str, dict[str, Any]] = {}
    self._ckptr = None

  def __enter__(self) -> "CheckpointWriter":
    self._dir.__enter__()
    try:
      os.makedirs(os.path.join(self.tmp, PARAMS_DIR))
    except OSError as e:
      self._dir.__exit__(None, None, None)
      raise CheckpointError(f"cannot write {self.tmp}: {e.strerror}") from None
    self._ckptr = ocp.PyTreeCheckpointer()
    return self

  def write(self, name: str, array: np.ndarray, layer: int | None = None) -> None:
    if name not in self.expected:
      raise CheckpointError(f"tensor {name} is not a parameter of this model; parameters: {sorted(self.expected)}")
    full, stacked = self.expected[name]
    if stacked != (layer is not None):
      raise CheckpointError(f"tensor {name}: {'a layer index is' if stacked else 'no layer index is'} expected")
    want = full[1:] if stacked else full
    if tuple(array.shape) != want:
      raise CheckpointError(f"tensor {name}{'' if layer is None else f' layer {layer}'} has shape "
                            f"{tuple(array.shape)}, the model config implies {want}")
    rows = part_rows(want, array.dtype.itemsize)
    entry = self.written.setdefault(name, {"shape": list(full), "dtype": str(array.dtype),
                                           "layers": full[0] if stacked else 0, "part_rows": rows,
                                           "done": set()})
    if entry["dtype"] != str(array.dtype):
      raise CheckpointError(f"tensor {name} layer {layer} has dtype {array.dtype}, earlier layers {entry['dtype']}")
    for part, start in enumerate(range(0, max(1, want[0] if want else 1), rows)):
      slab = array[start:start + rows] if want else array
      save_args = ocp.SaveArgs(chunk_byte_size=layout.CHUNK_BYTES) if slab.nbytes > layout.CHUNK_BYTES else ocp.SaveArgs()
      self._ckptr.save(item_dir(self.tmp, name, layer, part),
                       args=ocp.args.PyTreeSave({"value": slab}, save_args={"value": save_args}))
      del slab
    entry["done"].add(layer)

  def copy_file(self, path: str, name: str | None = None) -> None:
    shutil.copyfile(path, os.path.join(self.tmp, name or os.path.basename(path)))

  def write_text(self, name: str, text: str) -> None:
    with open(os.path.join(self.tmp, name), "w", encoding="utf-8") as f:
      f.write(text)

  def _finish(self) -> None:
    for name, (full, stacked) in self.expected.items():
      done = self.written.get(name, {}).get("done", set())
      missing = sorted(set(range(full[0])) - done) if stacked else ([] if done else [None])
      if missing:
        where = "" if missing == [None] else f" layers {missing}"
        raise CheckpointError(f"{self.source or self.dst}: tensor {name}{where} was never written")
    tensors = {n: {k: v for k, v in e.items() if k != "done"} for n, e in self.written.items()}
    self.write_text(CONFIG_FILE, json.dumps(self.cfg.to_dict(), indent=2))
    self.write_text(MANIFEST_FILE, json.dumps({"format": FORMAT, "source": self.source, "tensors": tensors},
                                              indent=2))
    self._dir.commit()

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is None:
        self._finish()
    finally:
      self._dir.__exit__(exc_type, exc, tb)
