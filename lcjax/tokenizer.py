"""Tokenizers of lcjax checkpoints: HF `tokenizer.json` (Llama 3, SmolLM2) or sentencepiece `tokenizer.model`
(Llama 2), with BOS/EOS as the model config says, the checkpoint's chat template, and streaming decode.

Layer L0: stdlib, numpy, sentencepiece, tokenizers, lcjax.chat_template (jinja2 only when a checkpoint has a chat
template).

    tok = Tokenizer(ckpt_dir)                 # BOS/EOS/add_bos from lcjax_config.json when present
    ids = tok.encode("Hello")                 # BOS prepended iff the model adds one (never a second)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    dec = IncrementalDecoder(tok); text = dec.push([id]) ... + dec.flush()
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Sequence

from lcjax import chat_template

_REPLACEMENT = "\ufffd"


def _read_json(path: str) -> dict:
  """A JSON object file of the tokenizer; TokenizerError naming the file when it is not one."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (ValueError, RecursionError) as e:     # JSONDecodeError, UnicodeDecodeError; nesting past the stack
    raise TokenizerError(f"{path}: not a readable JSON file: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}") from None
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: holds a JSON {type(data).__name__}, not an object")
  return data


def _token_str(t) -> str | None:
  if isinstance(t, dict):
    t = t.get("content")
  return t if isinstance(t, str) else None


# tokenizer_config.json's special tokens, the map transformers passes to every chat template it renders.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def infer_add_bos(path: str) -> bool | None:
  """Whether the model's own tokenizer prepends BOS, as its files say (None when they say nothing).

  `add_bos_token` in tokenizer_config.json wins; otherwise a `tokenizer.json` post-processor template that
  starts with a special token (Llama 3's `<|begin_of_text|>`) means yes and its absence no; a lone sentencepiece
  `tokenizer.model` means yes (LlamaTokenizer's default).
  """
  tc = os.path.join(path, "tokenizer_config.json")
  if os.path.exists(tc):
    v = _read_json(tc).get("add_bos_token")
    if isinstance(v, bool):
      return v
  tj = os.path.join(path, "tokenizer.json")
  if os.path.exists(tj):
    post = _read_json(tj).get("post_processor") or {}
    post = post if isinstance(post, dict) else {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs if isinstance(procs, list) else []:
      if isinstance(p, dict) and p.get("type") == "TemplateProcessing":
        single = p.get("single") or []
        return isinstance(single, list) and bool(single) and isinstance(single[0], dict) and "SpecialToken" in single[0]
    return False
  if os.path.exists(os.path.join(path, "tokenizer.model")):
    return True
  return None


def infer_bos_id(path: str) -> int | None:
  """The id of the BOS token the model's own tokenizer prepends, as its files say (None when they name none): the
  special token a `tokenizer.json` post-processor template starts with (what HF's fast tokenizers prepend), else
  tokenizer_config.json's bos_token looked up in the vocabulary, else a lone sentencepiece model's BOS."""
  tj, tm = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
  if os.path.exists(tj):
    post = _read_json(tj).get("post_processor") or {}
    post = post if isinstance(post, dict) else {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs if isinstance(procs, list) else []:
      single = p.get("single") if isinstance(p, dict) and p.get("type") == "TemplateProcessing" else None
      head = single[0] if isinstance(single, list) and single else None
      first = head.get("SpecialToken") if isinstance(head, dict) else None
      if isinstance(first, dict):
        ids = ((p.get("special_tokens") or {}).get(first.get("id")) or {}).get("ids")
        if isinstance(ids, list) and len(ids) == 1 and _is_id(ids[0]):
          return ids[0]
  tc = os.path.join(path, "tokenizer_config.json")
  bos = _token_str(_read_json(tc).get("bos_token")) if os.path.exists(tc) else None
  if bos is not None and (os.path.exists(tj) or os.path.exists(tm)):
    try:
      b = _HFBackend(tj) if os.path.exists(tj) else _SPBackend(tm)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is refused with its own error when it is loaded
      return None
    return b.token_to_id(bos)
  if os.path.exists(tm) and not os.path.exists(tj):
    import sentencepiece as spm
    try:
      i = spm.SentencePieceProcessor(model_file=tm).bos_id()
    except Exception:  # noqa: BLE001 - as above
      return None
    return i if i >= 0 else None
  return None


def _chat_template(path: str) -> tuple[str | None, str | None]:
  """(the checkpoint's chat template, the file it came from), compiled once (lcjax.chat_template.check)."""
  jinja = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja):
    try:
      with open(jinja, encoding="utf-8") as f:
        t = f.read()
    except UnicodeDecodeError as e:
      raise TokenizerError(f"{jinja}: not UTF-8 text (byte {e.start})") from None
    chat_template.check(t, jinja)
    return t, jinja
  for fname in ("chat_template.json", "tokenizer_config.json"):
    p = os.path.join(path, fname)
    if os.path.exists(p):
      t = _read_json(p).get("chat_template")
      if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
      if t:
        chat_template.check(t, p)
        return t, p
  return None, None


class _HFBackend:
  def __init__(self, path: str):
    from tokenizers import Tokenizer as HFTokenizer
    self.tok = HFTokenizer.from_file(path)
    self.special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special: bool) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special)

  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def id_to_token(self, i: int) -> str | None:
    return self.tok.id_to_token(i)

  def token_to_id(self, s: str) -> int | None:
    return self.tok.token_to_id(s)


class _SPBackend:
  """sentencepiece, with control tokens (<s>, </s>, <unk>) written in the text parsed as those tokens.

  Each text piece between control tokens is encoded on its own, so it gets sentencepiece's dummy-prefix space,
  as llama.cpp and HF's legacy LlamaTokenizer do.
  """

  def __init__(self, path: str):
    import sentencepiece as spm
    self.sp = spm.SentencePieceProcessor(model_file=path)
    n = self.sp.get_piece_size()
    self.control = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
    self.by_piece = {self.sp.id_to_piece(i): i for i in self.control}
    pieces = sorted(self.by_piece, key=len, reverse=True)
    self.split = re.compile("(" + "|".join(re.escape(p) for p in pieces) + ")") if pieces else None

  def encode(self, text: str) -> list[int]:
    parts = self.split.split(text) if self.split else [text]
    ids: list[int] = []
    for k, part in enumerate(parts):
      if k % 2:
        ids.append(self.by_piece[part])
      elif part:
        ids.extend(self.sp.encode(part))
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool) -> str:
    out, run = [], []
    for i in ids:
      if i in self.control:
        out.append(self.sp.decode(run))
        run = []
        if not skip_special:
          out.append(self.sp.id_to_piece(i))
      else:
        run.append(i)
    out.append(self.sp.decode(run))
    return "".join(out)

  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def id_to_token(self, i: int) -> str | None:
    return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

  def token_to_id(self, s: str) -> int | None:
    i = self.sp.piece_to_id(s)
    return None if i == self.sp.unk_id() and s != self.sp.id_to_piece(i) else i


_UNSET: Any = object()


class TokenizerError(ValueError):
  """A tokenizer file that cannot be read (truncated or corrupt); the message names the file."""


def _is_id(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


CHAT_SEPARATOR = "\n\n"          # between a document and a question in one user turn
CONTINUATION_HELD_TOKENS = 8       # tokens of a document's end re-encoded with each question (Tokenizer.continuable)
CONTINUATION_SEARCH = 256


@dataclasses.dataclass(frozen=True)
class ChatContinuation:
  """How a question continues a pinned chat document: the ids of `text(question)` follow the context's ids, and
  together they are the ids of the chat [{"role": "user", "content": document + separator + question}] with the
  assistant's turn opened (the template's one BOS, none added)."""
  held: str         # the document's last tokens, re-encoded with each question
  tail: str         # the template's text after the question: the user turn's end, the assistant turn's start
  separator: str = CHAT_SEPARATOR

  def text(self, question: str) -> str:
    return self.held + self.separator + question + self.tail

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "ChatContinuation":
    return cls(str(d["held"]), str(d["tail"]), str(d["separator"]))


@dataclasses.dataclass(frozen=True)
class ChatDocument:
  """A document split for a chat on a pinned context (Tokenizer.chat_document): `ids` are prefilled once,
  `continuation` turns each question into the rest of the chat."""
  ids: list[int]
  continuation: ChatContinuation


class Tokenizer:
  """A checkpoint's tokenizer.

  path: a directory with `tokenizer.json` (preferred, what HF uses) or `tokenizer.model`.
  bos_id, eos_ids, add_bos: default to the directory's `lcjax_config.json` (the model config), else to
    `tokenizer_config.json`'s bos_token / eos_token / add_bos_token.
  """

  def __init__(self, path: str, *, bos_id: int | None = _UNSET, eos_ids: Iterable[int] | None = None,
               add_bos: bool | None = None):
    self.path = path
    tj, tm = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
    if not (os.path.exists(tj) or os.path.exists(tm)):
      raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model")
    f = tj if os.path.exists(tj) else tm
    try:
      self._b = _HFBackend(tj) if f == tj else _SPBackend(tm)
    except Exception as e:  # tokenizers raises a bare Exception, sentencepiece a RuntimeError
      msg = (str(e).strip().splitlines() or [""])[0][:300]
      raise TokenizerError(f"{f}: not a readable tokenizer file: {type(e).__name__}: {msg}") from None
    tc = os.path.join(path, "tokenizer_config.json")
    conf = _read_json(tc) if os.path.exists(tc) else {}
    # What transformers hands a chat template beside the messages: its special-tokens map (the ones set).
    self.special_tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_str(conf.get(k)))}
    cfg = os.path.join(path, "lcjax_config.json")
    if os.path.exists(cfg):
      c = _read_json(cfg)
      d_bos, d_eos, d_add = c.get("bos_id"), c.get("eos_ids") or (), c.get("add_bos")
      if not (d_bos is None or _is_id(d_bos)) or not (isinstance(d_eos, (list, tuple))
                                                        and all(_is_id(i) for i in d_eos)):
        raise TokenizerError(f"{cfg}: bos_id={str(d_bos)[:40]} and eos_ids={str(d_eos)[:60]} must be token ids "
                             "(integers >= 0)")
    else:
      b, e = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
      d_bos = self._b.token_to_id(b) if b else None
      d_eos = (self._b.token_to_id(e),) if e and self._b.token_to_id(e) is not None else ()
      d_add = infer_add_bos(path)
    self.bos_id: int | None = d_bos if bos_id is _UNSET else bos_id
    self.eos_ids: tuple[int, ...] = tuple(int(i) for i in (d_eos if eos_ids is None else eos_ids))
    self.add_bos: bool = bool(d_add if add_bos is None else add_bos) and self.bos_id is not None
    self.chat_template, self.template_path = _chat_template(path)

  @property
  def vocab_size(self) -> int:
    return self._b.vocab_size()

  def id_to_token(self, i: int) -> str | None:
    return self._b.id_to_token(i)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids. BOS is
    prepended when the model adds one (or add_bos says so) and the text does not already start with it (a
    rendered chat template writes its own)."""
    ids = self._b.encode(text)
    if ((self.add_bos if add_bos is None else add_bos) and self.bos_id is not None
        and ids[:1] != [self.bos_id]):
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self._b.decode([int(i) for i in ids], skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The checkpoint's chat template rendered as HF transformers renders it (a sandboxed jinja2), within the
    bounds of lcjax.chat_template (ChatTemplateError past them or on the template's own errors)."""
    if self.chat_template is None:
      raise ValueError(f"{self.path}: the checkpoint has no chat template")
    eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
    bos = self.id_to_token(self.bos_id) if self.bos_id is not None else None
    # As transformers renders it: tools and documents None unless given, tokenizer_config.json's special tokens
    # (bos and eos from the model's ids where it names none).
    variables = dict(tools=None, documents=None, bos_token=bos or "", eos_token=eos or "")
    variables.update(self.special_tokens)
    variables.update(kwargs)
    return chat_template.render(self.chat_template, self.template_path, messages=list(messages),
                                add_generation_prompt=add_generation_prompt, **variables)

  def chat_context(self, document: str, system: str | None = None) -> tuple[str, str] | None:
    """Split the chat whose user turn is `document` followed by a question: (the text up to the document's end,
    the text after the question). None when the checkpoint has no chat template (or the template does not keep the
    turn's text verbatim). `system`: the text of a system turn before it (None: the template's default)."""
    if not self.chat_template:
      return None
    marker = "\x00lcjax-question\x00"
    messages = [{"role": "system", "content": system}] if system is not None else []
    rendered = self.apply_chat_template(messages + [{"role": "user", "content": f"{document}{marker}"}])
    head, found, tail = rendered.partition(marker)
    return (head, tail) if found else None

  def chat_document(self, document: str, system: str | None = None,
                    separator: str = CHAT_SEPARATOR) -> "ChatDocument":
    """`document` as the start of a chat's user turn, split for a pinned context (see ChatDocument): the ids to
    prefill once, and how each question continues them. Raises ValueError naming the reason when the checkpoint
    has no chat template or its template cannot be split there."""
    split = self.chat_context(document, system)
    if split is None:
      raise ValueError(f"{self.path}: the checkpoint has no chat template" if not self.chat_template else
                       f"{self.path}: the chat template does not keep the user turn's text verbatim, so a question "
                       "cannot continue a document in it")
    head, tail = split
    ids, held = self.continuable(head, separator + "?" + tail)
    return ChatDocument(ids, ChatContinuation(held, tail, separator))

  def continuable(self, text: str, probe: str) -> tuple[list[int], str]:
    """(ids, held): the ids of `text` without its last few tokens, and the text of those tokens, such that text
    followed by X encodes as ids + encode(held + X): a prefix of `text` whose tokens nothing appended to it can
    change (a BPE merges across the end of a text, e.g. a trailing newline with the next one). Checked with
    X = `probe`; held spans at least CONTINUATION_HELD_TOKENS tokens. Raises ValueError when no split within
    CONTINUATION_SEARCH tokens of the end passes the check."""
    ids = self.encode(text, add_bos=False)
    full = self.encode(text + probe, add_bos=False)
    same = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
    top = min(len(ids) - CONTINUATION_HELD_TOKENS, same)
    for m in range(top, max(0, top - CONTINUATION_SEARCH), -1):
      held = self.decode(ids[m:])
      if _REPLACEMENT in held or not text.endswith(held):   # m splits a character, or decoding is not exact
        continue
      if self.encode(held + probe, add_bos=False) == full[m:]:
        return ids[:m], held
    raise ValueError(f"{self.path}: no split of the text's last {CONTINUATION_SEARCH} tokens re-encodes the same "
                     f"with {probe[:20]!r} appended ({len(ids)} tokens): this tokenizer cannot continue it")

  def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Ids of the rendered chat; no extra BOS, since templates that want one write it themselves."""
    return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_bos=False)


TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model")


def find_tokenizer(path: str) -> Tokenizer | None:
  """The Tokenizer of a checkpoint directory, or None when it has no tokenizer file."""
  if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_MODEL_FILES):
    return Tokenizer(path)
  return None


class IncrementalDecoder:
  """Text deltas from a growing list of ids, never cutting a UTF-8 character in half.

  It decodes a short window (the last emitted ids as context, plus the new ones) and emits the text beyond the
  context once it no longer ends in U+FFFD (an incomplete byte sequence); the context keeps sentencepiece's
  leading-space handling and byte-level merges right at the window's edge. `flush()` returns whatever is held
  back at the end. The concatenated deltas equal `tokenizer.decode(all_ids)` for valid UTF-8 text.
  """

  def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
    self.tok = tokenizer
    self.skip = skip_special_tokens
    self.ids: list[int] = []
    self._prefix = 0  # start of the context window
    self._read = 0    # ids before this are emitted

  def _texts(self) -> tuple[str, str]:
    ctx = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
    return ctx, self.tok.decode(self.ids[self._prefix:], self.skip)

  def push(self, ids: Iterable[int]) -> str:
    self.ids.extend(int(i) for i in ids)
    ctx, text = self._texts()
    if len(text) > len(ctx) and not text.endswith(_REPLACEMENT):
      self._prefix, self._read = self._read, len(self.ids)
      return text[len(ctx):]
    return ""

  def flush(self) -> str:
    ctx, text = self._texts()
    self._prefix = self._read = len(self.ids)
    return text[len(ctx):]
