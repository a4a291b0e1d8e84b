"""On-the-fly synthetic training data for the demo models."""

from __future__ import annotations

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer briefly.",
    "You are a helpful assistant. Answer with a single word.",
    "You are a vision assistant. Look at the image carefully and answer the question.",
    "Be concise.",
    "You are a friendly and precise assistant that describes images. Keep answers short and "
    "accurate, and reply in English.",
)
