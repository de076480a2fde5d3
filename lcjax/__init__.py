"""lcjax: long-context LLaMA inference in JAX.

    import lcjax
    engine = lcjax.Engine.load("path/to/hf-folder-or-model.gguf-or-lcjax-checkpoint")
    out = engine.generate("The capital of France is", max_new_tokens=16)
    print(out.text, out.stats)

    with engine.prefill(long_document) as ctx:          # prefilled once, pinned until closed
      for q in questions:
        print(engine.generate(q, context=ctx).text)
      ctx.save("doc.ctx")                               # engine.load_context("doc.ctx") in a later process

Names are imported lazily so that `import lcjax.config` (or the host allocator) does not pull in JAX.
"""
from __future__ import annotations

import importlib

_API = {
    "Engine": "lcjax.engine.engine",
    "GenerationResult": "lcjax.engine.engine",
    "RequestError": "lcjax.engine.requests",
    "Context": "lcjax.engine.context",
    "ContextError": "lcjax.engine.context",
    "SamplingParams": "lcjax.engine.sampling",
    "ModelConfig": "lcjax.config",
    "RunConfig": "lcjax.config",
    "ConfigError": "lcjax.config",
    "preset": "lcjax.config",
    "PRESETS": "lcjax.config",
    "Tokenizer": "lcjax.tokenizer",
    "MemoryPlan": "lcjax.engine.plan",
    "plan": "lcjax.engine.plan",
    "convert_hf": "lcjax.checkpoint",
    "convert_gguf": "lcjax.checkpoint",
}
__all__ = sorted(_API)
__version__ = "0.1.0"


def __getattr__(name):
  if name in _API:
    return getattr(importlib.import_module(_API[name]), name)
  raise AttributeError(f"module 'lcjax' has no attribute {name!r}")
