"""What a request must be before it is queued: its prompt as token ids, in the vocabulary and
leaving room for a generated token, and its stop ids in the vocabulary. A bad request is a
ValueError naming what is wrong (the server answers 400), and nothing is queued."""

from __future__ import annotations

from tokenmill.sampling_params import SamplingParams


def prompt_ids(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """A string, {"prompt_token_ids": [...]}, or {"prompt": "..."} -> (text, token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass prompt_token_ids instead of text")
    return prompt, tokenizer.encode(prompt)


def check_prompt(ids: list[int], vocab: int, max_model_len: int) -> None:
    if not ids:
        raise ValueError("prompt is empty: it must have at least one token")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens but max_model_len is {max_model_len}; "
            "the prompt must leave room for at least one generated token"
        )


def check_params(params: SamplingParams, vocab: int) -> None:
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:  # beyond the vocabulary they can never be sampled (nor banned by min_tokens)
        raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[:3]}")
