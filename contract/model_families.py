"""What a model family needs that its file may not say: a chat template and the end-of-turn
token. A GGUF converted from a base model often carries neither (Gemma 3 270M's has no
`tokenizer.chat_template` and names only `<eos>` as its end), yet the family's turn format is
fixed by its makers; without these a chat would be refused, or would run on past the turn's
end. A template given with --chat-template still wins (runtime/engine.py applies it after).
"""
from __future__ import annotations

import dataclasses

from contract.config import ModelConfig
from contract.tokenizer import Tokenizer

# Google's Gemma 3 turn format: no system role (a system message opens the first user turn),
# "model" for the assistant, each turn closed by <end_of_turn>
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ (message['content'] or '') | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}
END_OF_TURN = {"gemma3": "<end_of_turn>"}


def with_family_defaults(config: ModelConfig, tokenizer: Tokenizer
                         ) -> tuple[ModelConfig, Tokenizer]:
    """The config with the family's end-of-turn token among its stop ids, and the tokenizer
    with the family's chat template where the file has none."""
    family = config.architecture
    if tokenizer.chat_template is None and family in CHAT_TEMPLATES:
        tokenizer = tokenizer.with_chat_template(CHAT_TEMPLATES[family])
    end = END_OF_TURN.get(family)
    end_id = tokenizer.backend.token_to_id(end) if end else None
    if end_id is not None and end_id not in config.eos_token_ids:
        config = dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, end_id))
    return config, tokenizer
