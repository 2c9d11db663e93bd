"""Synthetic benchmark prompts: random common English words (about one token each for BPE
tokenizers), fixed or random lengths, optionally behind a prefix every prompt shares."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first "
    "water been call who its now find long down day did get come made may part over new sound "
    "take only little work know place year live me back give most very after thing our just name "
    "good sentence man think say great where help through much before line right too mean old"
).split()


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # in words: the server's usage reports the real token count
    output_len: int


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1; r = 0 is fixed."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    shared_prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    if num < 1 or input_len < 1 or output_len < 1 or shared_prefix_len < 0:
        raise ValueError("num_prompts, input_len and output_len must be >= 1, "
                         "shared_prefix_len >= 0")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = random_words(rng, shared_prefix_len)
    inputs = sample_lengths(rng, input_len, range_ratio, num)
    outputs = sample_lengths(rng, output_len, range_ratio, num)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        text = " ".join(filter(None, [prefix, random_words(rng, n_in)]))
        requests.append(BenchRequest(text, shared_prefix_len + n_in, n_out))
    return requests
