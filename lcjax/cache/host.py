"""The host tier of the prefix cache: K/V of full pages evicted from the device, kept in host memory by their
prefix-cache key until a prompt that starts with the same tokens brings them back (layer L0: no JAX).

Entries are opaque host arrays (numpy, or JAX arrays in pinned host memory) of one page each, for every layer;
the tier keeps at most `budget_bytes` of them and drops the least recently used first.
"""
from __future__ import annotations

import collections
from typing import Any


class HostTier:
  def __init__(self, budget_bytes: int):
    if budget_bytes < 0:
      raise ValueError(f"{budget_bytes=} must be >= 0")
    self.budget_bytes = budget_bytes
    self.bytes = 0
    self._entries: collections.OrderedDict[bytes, tuple[Any, int]] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, key: bytes) -> bool:
    return key in self._entries

  def put(self, key: bytes, value: Any, nbytes: int) -> None:
    """Keep `value` (nbytes of host memory) under `key`, dropping the least recently used entries to fit."""
    if nbytes > self.budget_bytes:
      return
    self.drop(key)
    while self.bytes + nbytes > self.budget_bytes:
      _, (_, n) = self._entries.popitem(last=False)
      self.bytes -= n
    self._entries[key] = (value, nbytes)
    self.bytes += nbytes

  def take(self, key: bytes) -> Any:
    """The value under `key`, removed from the tier (it goes back to the device)."""
    value, n = self._entries.pop(key)
    self.bytes -= n
    return value

  def drop(self, key: bytes) -> None:
    if key in self._entries:
      self.bytes -= self._entries.pop(key)[1]

  def clear(self) -> None:
    self._entries.clear()
    self.bytes = 0
