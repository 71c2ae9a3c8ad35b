"""Chat templates: the checkpoint's own, rendered by transformers' implementation.

The template comes from the exported model directory (`chat_template.jinja`, or `chat_template`
in `tokenizer_config.json`, as Hugging Face saves them) or from a file given by the operator.
A model without one has no chat route: turning messages into a prompt is the model's business,
and a guessed format would give plausible-looking nonsense.
"""

from __future__ import annotations

import json
from pathlib import Path


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens  # bos_token, eos_token, ...: templates refer to them

    @classmethod
    def find(cls, model_dir: Path | None, override: Path | None = None) -> ChatTemplate | None:
        config = _tokenizer_config(model_dir)
        special = {k: _content(v) for k, v in config.items() if k.endswith("_token") and _content(v) is not None}
        if override is not None:
            return cls(override.read_text(), special)
        if model_dir is not None and (model_dir / "chat_template.jinja").is_file():
            return cls((model_dir / "chat_template.jinja").read_text(), special)
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(template, special) if isinstance(template, str) else None

    def render(self, messages: list[dict]) -> str:
        """The prompt for `messages`, ending where the assistant's answer begins."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([messages], chat_template=self.source, add_generation_prompt=True,
                                            **self.special_tokens)
        return rendered[0]


def _tokenizer_config(model_dir: Path | None) -> dict:
    path = model_dir / "tokenizer_config.json" if model_dir else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


def _content(token) -> str | None:
    if isinstance(token, dict):  # AddedToken, serialised
        token = token.get("content")
    return token if isinstance(token, str) else None
