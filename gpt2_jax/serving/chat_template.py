"""A chat template: HuggingFace's `chat_template` convention (a Jinja template of `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`, with `raise_exception`), rendered in jinja2's
ImmutableSandboxedEnvironment, set up as transformers' apply_chat_template sets it up (trim_blocks,
lstrip_blocks, loop controls, its tojson and strftime_now), so a template renders here as it does there.

Where it comes from (`find`): `gpt2-jax serve --chat-template FILE`, else the `chat_template` of the model
directory's tokenizer_config.json (a string, or HF's list of named templates: "default"), else none. A template
that does not parse stops the server at start-up with a ConfigError naming its file and line.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from gpt2_jax.errors import ConfigError, GPT2JaxError

EOT_TEXT = "<|endoftext|>"  # GPT-2's one special token: its BOS and EOS


class ChatTemplateError(GPT2JaxError):
    """The template failed on a request's messages (its own raise_exception, or any error while rendering)."""


class TooLong(ChatTemplateError):
    """The rendered prompt grew past the limit; rendering stopped there."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A parsed chat template and where it came from (`origin`, named in errors and in the start-up log)."""

    def __init__(self, source: str, origin: str):
        import jinja2

        self.source, self.origin = source, origin
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template {origin} does not parse: line {e.lineno}: {e.message}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --chat-template {path}: {getattr(e, 'strerror', None) or e}") from None
        return cls(source, f"--chat-template {path}")

    def render(self, messages: list[dict], add_generation_prompt: bool, limit: int) -> str:
        """The prompt text; TooLong once it passes `limit` characters (rendering stops there), ChatTemplateError
        for anything the template raises."""
        pieces, size = [], 0
        try:
            for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=EOT_TEXT, eos_token=EOT_TEXT):  # fmt: skip
                size += len(piece)
                if size > limit:
                    raise TooLong(f"the rendered chat prompt is over {limit} characters")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as e:  # the template is code: whatever it raises is its answer to these messages
            import jinja2

            what = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
            raise ChatTemplateError(f"the chat template ({self.origin}) failed: {what}{e}") from None
        return "".join(pieces)


def _from_tokenizer_config(model_path: Path) -> ChatTemplate | None:
    """The chat_template of tokenizer_config.json beside the checkpoint (in its directory, or beside its file)."""
    folder = model_path if model_path.is_dir() else model_path.parent
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # HF's named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ConfigError(f"{path}: chat_template must be a string or a list of named templates")
    return ChatTemplate(source, f"{path}'s chat_template")


def find(flag: str | None, model_path: Path | None) -> ChatTemplate | None:
    """--chat-template FILE, else the model's tokenizer_config.json chat_template, else None."""
    if flag is not None:
        return ChatTemplate.from_file(flag)
    return None if model_path is None else _from_tokenizer_config(model_path)
