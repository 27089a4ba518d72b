"""The argument checks the text encoders' `encode` make, in one wording."""

from __future__ import annotations


def prompt_list(prompts: str | list[str], name: str) -> list[str]:
    """`prompts` as a non-empty list of strings (a single string is one prompt)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"{name} must be a string or a list of strings, got {prompts!r:.80}")
    if not prompts:
        raise ValueError(f"{name} is empty; give at least one prompt (an empty string is a valid prompt)")
    return list(prompts)


def check_count(value: object, name: str) -> None:
    """A ValueError unless `value` (`num_images_per_prompt`, `num_prompts`) is a positive integer."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r} is not a positive integer")


def check_sequence_length(value: object, limit: int, tokens: str) -> None:
    """A ValueError unless `max_sequence_length` `value` is in 1..`limit`; `tokens` says whose limit it is
    ("FLUX.1 takes at most 512 T5 tokens")."""
    if not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"max_sequence_length {value!r} is not in 1..{limit} ({tokens})")
