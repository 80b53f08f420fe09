"""Chats: templates, their tokenization, llama.cpp's built-in templates, the chat session.

Owns the bounded Jinja chat templates (:mod:`.template`, rendered in :mod:`.sandbox`),
turning a rendered chat into tokens with control tokens only from the template
(:mod:`.tokens`), llama.cpp's built-in templates (:mod:`.builtin`, rendered by
:mod:`mars_local.llama.templates`) and the message list of a chat session (:mod:`.session`).
May import: :mod:`mars_local.core`, :mod:`mars_local.llama`.
"""
