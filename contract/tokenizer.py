"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special ids and chat template.

Built either from GGUF metadata (`from_gguf_metadata`) or from a Hugging Face folder
(`from_hf_folder`); `to_json` / `from_json` carry it in the worker's Ready frame to the gateway.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from contract.errors import InvalidRequestError, ModelLoadError, StartError, one_line
from contract.gguf_spm import decodes_byte_fallback, piece_bytes, spm_backend
from contract.json_files import read_json
from contract.tool_template import fallback, for_template, uses_tools

CONTROL_TOKEN = 3  # llama.cpp token_type values
USER_DEFINED_TOKEN = 4

# Split patterns of the byte-level vocabularies we know, keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str | None):
    """The pre-tokenizer for a GGUF `pre` name.

    'smollm' follows the original SmolLM2 tokenizer.json (each digit alone, then GPT-2's byte-level
    regex), which llama.cpp also does; transformers' GGUF converter drops the digit split, so
    numbers tokenize differently there. Unknown names fall back to plain GPT-2 splitting.
    """
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # bytes without a printable form are moved past 255, in order
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _content(token) -> str | None:
    """An HF special token entry is either a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    """Text <-> ids, special ids, chat template. Immutable after construction."""

    def __init__(self, backend: Backend, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None = None,
                 add_bos_token: bool = False):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # SentencePiece-style: "▁" is a space and `<0xNN>` pieces are single bytes
        self._byte_fallback = not self._byte_level and decodes_byte_fallback(backend)
        self._template = _compile(chat_template)
        # a template that reads `tools` has its own tool syntax; others get the fallback
        self.template_knows_tools = chat_template is not None and "tools" in \
            jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))

    # construction

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """From the `tokenizer.ggml.*` values (keys without that prefix) and `chat_template`:
        byte-level BPE ("gpt2") or SentencePiece ("llama", contract/gguf_spm.py)."""
        model = meta.get("model")
        if model not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {model!r} (want gpt2 or llama)")
        tokens, types = meta["tokens"], meta.get("token_type") or [1] * len(meta["tokens"])
        if model == "llama":  # its control and user-defined tokens are added there
            backend = spm_backend(meta)
        else:
            merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or ()]
            backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=merges))
            backend.pre_tokenizer = _pre_tokenizer(meta.get("pre"))
            backend.decoder = decoders.ByteLevel()
            # whole-match control tokens, else "<|im_start|>" would be split into pieces
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                        for t, k in zip(tokens, types) if k == CONTROL_TOKEN])
            backend.add_tokens([AddedToken(t, special=False, normalized=False)
                                for t, k in zip(tokens, types) if k == USER_DEFINED_TOKEN])
        bos = meta.get("bos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos = bool(meta.get("add_bos_token", model == "llama")) and bos is not None
        if add_bos:
            bos_text = tokens[bos]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, bos)])
        eos = [meta[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if meta.get(k) is not None]
        return cls(backend, bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)),
                   chat_template=meta.get("chat_template"), add_bos_token=add_bos)

    @classmethod
    def from_hf_folder(cls, folder: str, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """From `tokenizer.json` and, if present, tokenizer_config.json / chat_template.jinja."""
        try:
            backend = Backend.from_file(os.path.join(folder, "tokenizer.json"))
        except Exception as e:
            raise ModelLoadError(f"{folder}: cannot read tokenizer.json: {e}") from e
        cfg = read_json(os.path.join(folder, "tokenizer_config.json"), required=False)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates; the unnamed use is "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        bos_text, eos_text = _content(cfg.get("bos_token")), _content(cfg.get("eos_token"))
        bos = backend.token_to_id(bos_text) if bos_text else None
        eos = [backend.token_to_id(eos_text)] if eos_text else []
        eos = [i for i in [*eos, *extra_eos_ids] if i is not None]
        return cls(backend, bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)),
                   chat_template=template, add_bos_token=bool(cfg.get("add_bos_token", False)))

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """This tokenizer with another chat template (--chat-template); itself for None."""
        if chat_template is None:
            return self
        return Tokenizer(self.backend, bos_token_id=self.bos_token_id,
                         eos_token_ids=self.eos_token_ids, chat_template=chat_template,
                         add_bos_token=self.add_bos_token)

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend.to_str(), "bos_token_id": self.bos_token_id,
                           "eos_token_ids": list(self.eos_token_ids),
                           "chat_template": self.chat_template,
                           "add_bos_token": self.add_bos_token})

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        d = json.loads(text)
        return cls(Backend.from_str(d["backend"]), bos_token_id=d["bos_token_id"],
                   eos_token_ids=tuple(d["eos_token_ids"]), chat_template=d["chat_template"],
                   add_bos_token=d["add_bos_token"])

    # text <-> ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; BOS is added only when asked and the model wants one."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_without_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`encode(text)`, releasing the GIL while the Rust tokenizer runs (its batch entry
        point does; the single one does not), so a long text can be tokenized in a thread
        while the event loop goes on."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise InvalidRequestError(f"token id {token_id} is out of range", param="token_ids")
        if token_id in self._special_ids:
            return piece.encode("utf-8")
        if self._byte_fallback:
            return piece_bytes(piece)
        if not self._byte_level:
            return piece.encode("utf-8")
        table = _byte_decoder()
        return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render `messages` with the model's template (like HF's, no BOS added afterwards).

        `tools` (OpenAI function tools) and the messages' `tool_calls` and `tool` turns go to a
        template with tool syntax as Hugging Face's convention has them; a template without
        gets contract/tool_template.py's documented fallback in plain turns."""
        _check_messages(messages)
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt",
                                      param="messages")
        if self.template_knows_tools:
            messages = for_template(messages)
        elif tools or uses_tools(messages):
            messages, tools = fallback(messages, tools), None
        tokens = self.backend.id_to_token
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=tokens(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=tokens(self.eos_token_ids[0]) if self.eos_token_ids else "", **extra)
        except jinja2.TemplateError as e:  # includes raise_exception()
            raise InvalidRequestError(f"chat template rejected the messages: {e}",
                                      param="messages") from e

def _compile(template: str | None):
    if template is None:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    # like HF's: keep non-ASCII text readable inside prompts
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                              indent=indent)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"chat template does not compile: {e}") from e


def load_chat_template(value: str | None) -> str | None:
    """The template `--chat-template` names, as vLLM reads it: text with a brace or a line
    break is the template itself, anything else a file holding one. A file that cannot be read
    or a template that does not compile is a StartError naming the flag, so the gateway refuses
    it before any worker starts, and a worker given it directly refuses it too."""
    if value is None:
        return None
    is_text = any(c in value for c in "{}\n")
    shown = _abbreviated(value) if is_text else value  # a path is shown whole
    text = value
    if not is_text:
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
            raise StartError(f"--chat-template {shown}: cannot read it ({reason}); give a "
                             f"Jinja template file or the template text itself") from e
    try:
        _compile(text)
    except ModelLoadError as e:
        raise StartError(f"--chat-template {shown}: {one_line(e.__cause__ or e)} (the "
                         f"template does not compile)") from e
    return text


def _abbreviated(text: str, most: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[:most - 3] + "..."


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str) \
                or not isinstance(m.get("tool_calls", []), (list, tuple)):
            raise InvalidRequestError(f"messages[{i}] must be {{'role': str, 'content': str}}"
                                      " (and optionally 'tool_calls': a list)",
                                      param="messages")
