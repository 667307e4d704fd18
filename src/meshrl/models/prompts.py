"""Turn a user message (plus optional system prompt and assistant prefix) into prompt token ids."""

from __future__ import annotations


def _template_text(tokenizer, user_text: str, system: str | None) -> str:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user_text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(
    tokenizer,
    user_text: str,
    *,
    system: str | None = None,
    assistant_prefix: str | None = None,
) -> list[int]:
    """Token ids of a prompt that ends where the model's reply begins.

    With a chat template, the messages are rendered with ``add_generation_prompt=True`` and the
    rendered text is encoded without adding special tokens again (the template already has them).
    Without one, the prompt is ``system + "\\n\\n" + user_text`` encoded as plain text.

    ``assistant_prefix`` is text that starts the assistant turn (e.g. a coach prefix); its tokens are
    encoded on their own and appended, so the caller knows exactly which trailing ids belong to it
    (``len(encode_prompt(...)) - len(encode_prompt(..., assistant_prefix=None))``) and can mask them.
    """
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.encode(_template_text(tokenizer, user_text, system), add_special_tokens=False)
    else:
        text = user_text if system is None else f"{system}\n\n{user_text}"
        ids = tokenizer.encode(text)
    if assistant_prefix:
        ids = ids + tokenizer.encode(assistant_prefix, add_special_tokens=False)
    return list(ids)
