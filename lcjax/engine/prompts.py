"""Prompts into requests: a prompt (text, token ids or chat messages) encoded and checked against the engine's
limits (lcjax.engine.requests.Limits), then made a scheduler Request with its own sampling seed.

Every function takes the engine's tokenizer (None: prompts are token ids) and limits as they are at the call.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np

from lcjax.engine.context import Context
from lcjax.engine.requests import Limits, RequestError
from lcjax.engine.sampling import SamplingParams
from lcjax.engine.scheduler import Request


def check_callback(on_progress) -> None:
  if on_progress is not None and not callable(on_progress):
    raise RequestError(f"on_progress={on_progress!r} must be a callable or None")


def token_ids(prompt) -> list[int]:
  """A prompt of token ids as a list of ints: a sequence or 1-D array of integers (never floats or bools)."""
  if isinstance(prompt, np.ndarray):
    if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
      raise RequestError(f"a prompt of token ids is a 1-D integer array, not {prompt.dtype} {prompt.shape}")
    return prompt.tolist()
  if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, str)):
    raise RequestError(f"a prompt is text or a sequence of token ids, not {type(prompt).__name__} "
                       f"{repr(prompt)[:60]}")
  bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral)]
  if bad:
    raise RequestError(f"token ids are integers, not {bad[:5]!r}")
  return [int(t) for t in prompt]


def encode(tokenizer, limits: Limits, prompt, add_bos: bool | None = None) -> list[int]:
  """Token ids of a prompt (text or ids); add_bos=None: the tokenizer's rule for text (ids are kept as
  given), False: no BOS (text that continues a context)."""
  if isinstance(prompt, str):
    if tokenizer is None:
      raise RequestError("this engine has no tokenizer: pass token ids instead of text")
    if not prompt:
      raise RequestError("empty prompt: give at least one token")
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as e:   # lone surrogates: the tokenizer would fail with a TypeError
      raise RequestError(f"the prompt is not valid Unicode: {e.reason} {prompt[e.start:e.end]!r} at index "
                         f"{e.start}") from None
    ids = tokenizer.encode(prompt, add_bos=add_bos)
    if not ids:   # e.g. SmolLM2's vocabulary drops "\x16": prefill would have nothing to start from
      raise RequestError(f"the prompt {prompt[:40]!r} encodes to no tokens: its characters are not in the "
                         "tokenizer's vocabulary")
    limits.check_ids(ids)        # a tokenizer larger than the model's vocabulary
    return ids
  ids = token_ids(prompt)
  if not ids:
    raise RequestError("empty prompt: give at least one token")
  limits.check_ids(ids)
  return ids


def check_chat_template(tokenizer) -> None:
  if tokenizer is None or not tokenizer.chat_template:
    where = "this engine has no tokenizer" if tokenizer is None else f"{tokenizer.path} has none"
    raise RequestError(f"chat=True needs a checkpoint with a chat template; {where}")


def chat_ids(tokenizer, limits: Limits, prompt) -> list[int]:
  """A text prompt as the user turn of a chat, or a list of {"role", "content"} messages, through the
  checkpoint's chat template (which writes its own BOS)."""
  check_chat_template(tokenizer)
  messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
              list(prompt) if isinstance(prompt, Sequence) else [])
  if not messages or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
    raise RequestError(f"a chat prompt is text or a non-empty list of {{'role', 'content'}} messages, not "
                       f"{repr(prompt)[:60]}")
  return encode(tokenizer, limits, tokenizer.encode_chat(messages))


def question_ids(tokenizer, limits: Limits, question, chat) -> list[int]:
  """The ids that continue a chat context (lcjax.tokenizer.ChatContinuation) with a text question."""
  if not isinstance(question, str):
    raise RequestError(f"a question about a chat context is text, not {str(question)[:60]!r}")
  if not question:
    raise RequestError("empty question: give at least one character")
  return encode(tokenizer, limits, chat.text(question), add_bos=False)


def document_ids(tokenizer, limits: Limits, document, chat: bool, system) -> tuple[list[int], object]:
  """(ids, chat continuation or None) of a document to prefill as a context: its ids, or with chat=True the
  checkpoint's chat up to the end of the document in the user turn (after a system turn of `system`, or the
  template's default; lcjax.tokenizer.ChatDocument)."""
  if system is not None and not isinstance(system, str):
    raise RequestError(f"system= takes the text of a system turn, not {type(system).__name__} "
                       f"{repr(system)[:60]}")
  if chat:
    check_chat_template(tokenizer)
    if not isinstance(document, str):
      raise RequestError(f"chat=True prefills a text document, not {str(document)[:60]!r}")
    if not document:
      raise RequestError("empty document: give at least one character")
    try:
      split = tokenizer.chat_document(document, system)
    except ValueError as e:
      raise RequestError(str(e)) from None
    return encode(tokenizer, limits, split.ids), split.continuation
  if system is not None:
    raise RequestError(f"system={repr(system)[:40]} is a chat turn: give chat=True too")
  return encode(tokenizer, limits, document), None


def prompt_ids(tokenizer, limits: Limits, prompt, *, head: list[int] = (), chat: bool = False,
               continuation=None) -> list[int]:
  """The ids a call asks with one prompt, `head` included: with `continuation`, head and a text question that
  continues a chat context; with chat=True, the prompt through the chat template; else head (a prefix's or a plain
  context's ids) and the prompt with no BOS, or without a head the prompt with the tokenizer's BOS rule. The one
  definition of a prompt: Engine.generate and the CLI (before its engine exists) both build it here."""
  if continuation is not None:
    return list(head) + question_ids(tokenizer, limits, prompt, continuation)
  if chat:
    return chat_ids(tokenizer, limits, prompt)
  return list(head) + encode(tokenizer, limits, prompt, add_bos=False if head else None)


def make_requests(tokenizer, limits: Limits, prompts, max_new_tokens, sampling, head: list[int] = (),
                  chat: bool = False, continuation=None) -> list[Request]:
  """Requests of prompts that follow `head` (a prefix's or context's ids; the prompts then get no BOS), or with
  `continuation`, questions that continue a chat context. Prompt i samples with seed `sampling.seed + i`, so
  the prompts of a batch draw independently and a call is reproducible."""
  Limits.check_max_new(max_new_tokens)
  try:
    sp = SamplingParams.make(sampling)
  except (TypeError, ValueError) as e:
    raise RequestError(str(e)) from None
  head = list(head)
  reqs = []
  for i, p in enumerate(prompts):
    ids = prompt_ids(tokenizer, limits, p, head=head, chat=chat, continuation=continuation)
    limits.check(i, ids, max_new_tokens, prefix_len=len(head))
    own = dataclasses.replace(sp, seed=(sp.seed + i) % 2**32)
    reqs.append(Request(i, ids, int(max_new_tokens), own, prefix_len=len(head)))
  return reqs


def as_list(prompts) -> tuple[list, bool]:
  """A str, a flat sequence of numbers (token ids, refused by `encode` unless integers) or a list of chat
  messages (dicts) is one prompt; any other sequence is a list of prompts."""
  if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                  and all(isinstance(t, (numbers.Number, np.generic, dict)) for t in prompts)):
    return [prompts], True
  if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
    return [prompts], True
  if not isinstance(prompts, (Sequence, np.ndarray)) or isinstance(prompts, bytes):
    raise RequestError(f"prompts are text, token ids or a list of them, not {type(prompts).__name__} "
                       f"{repr(prompts)[:60]}")
  prompts = list(prompts)
  if not prompts:
    raise RequestError("no prompts given")
  return prompts, False


def requests(engine, prompts, max_new_tokens, sampling, prefix, context, chat=False):
  """(requests, single prompt?, prefix ids to pin for the call or None) of a call of `engine` (its tokenizer and
  limits; a context must be one of its own)."""
  tokenizer, limits = engine.tokenizer, engine.limits
  if prefix is not None and context is not None:
    raise RequestError("give prefix= or context=, not both")
  if chat and prefix is not None:
    raise RequestError("chat=True renders whole conversations, not a prefix=: for questions about one document, "
                       "prefill it with engine.prefill(document, chat=True) and pass context=")
  plist, single = as_list(prompts)
  if context is not None:
    if not isinstance(context, Context):
      raise RequestError(f"context= takes a Context (from engine.prefill or engine.load_context), not "
                         f"{type(context).__name__} {repr(context)[:60]}")
    context._check_usable(engine)
    if chat and context.chat is None:
      raise RequestError("chat=True continues a context prefilled with engine.prefill(document, chat=True); this "
                         "one was prefilled without chat")
    if not chat and context.chat is not None:
      raise RequestError("this context is an open chat turn (prefilled with chat=True): ask with chat=True")
    reqs = make_requests(tokenizer, limits, plist, max_new_tokens, sampling, head=context.token_ids,
                         continuation=context.chat)
    for r in reqs:
      r.prefix_seq = context.seq
    return reqs, single, None
  if chat:
    return make_requests(tokenizer, limits, plist, max_new_tokens, sampling, chat=True), single, None
  head = encode(tokenizer, limits, prefix) if prefix is not None else []
  return make_requests(tokenizer, limits, plist, max_new_tokens, sampling, head=head), single, (head or None)
