"""Checkpoint I/O (layer L4): HF safetensors and GGUF conversion, orbax restore into the model's parameters.

    convert_hf(src_dir, ckpt_dir)          HF LLaMA folder -> lcjax checkpoint
    convert_gguf(file, ckpt_dir)           llama GGUF (any quantization, dequantized) -> lcjax checkpoint
    load_config(ckpt_dir) -> ModelConfig   (refuses incomplete checkpoints)
    restore_params(ckpt_dir, abstract_state, shardings=None, dtype=None) -> state for nnx.update
    load_checkpoint(ckpt_dir, dtype=..., mesh=None) -> (ModelConfig, params, Tokenizer or None)
"""
from lcjax.checkpoint.layout import CheckpointError, load_config, param_shapes
from lcjax.checkpoint.restore import load_checkpoint, restore_params
from lcjax.checkpoint.hf import convert_hf
from lcjax.checkpoint.gguf import convert_gguf

__all__ = ["CheckpointError", "convert_gguf", "convert_hf", "load_checkpoint", "load_config", "param_shapes",
           "restore_params"]
