"""Structured outputs in the engine, on llguidance: one matcher per constrained sequence, the
token masks of all constrained sequences of a step computed together (llguidance's executor,
in parallel and without the GIL) on a worker thread while the model runs its forward pass,
and each sampled token fed back to its matcher.

The engine asks for the masks before the forward pass (`start`): a sequence's grammar state
only depends on the tokens it already has, so the mask work overlaps the model's and an
unconstrained sequence never waits for it. The sampler applies the masks (GrammarMasks)
after penalties, before temperature and top-k/p. A sequence whose grammar is complete stops
(finish reason "stop").
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")


@dataclass
class PendingMasks:
    """The masks of one step under way: for targets[j] in `indices`, row k of the bitmask."""

    indices: list[int]  # positions in the step's list of sampled sequences
    future: Future
    owner: StructuredOutputs

    def bitmask(self) -> torch.Tensor:
        """(len(indices), ceil(vocab / 32)) int32: bit t of a row allows token t."""
        start = time.perf_counter()
        result = self.future.result()
        self.owner.wait_seconds += time.perf_counter() - start
        return result


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        # what the masks cost: rows computed, seconds computing them (on the worker thread),
        # seconds the sampler waited for them (the part the forward pass did not hide)
        self.mask_rows, self.mask_seconds, self.wait_seconds = 0, 0.0, 0.0

    @functools.cached_property
    def _llg(self):
        """llguidance's tokenizer (~0.3 s to build for a 49K vocabulary) and executor, made
        at the first constrained request."""
        import llguidance

        tok = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                     eos_token=self.eos_token_ids)
        return llguidance, tok, llguidance.LLExecutor()

    def check(self, params: SamplingParams) -> str | None:
        """The request's compiled grammar (None if unconstrained); ValueError naming the
        problem if it cannot be compiled."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has "
                             "none")
        llg, tok, _ = self._llg
        spec = so.grammar_spec()
        error = llg.LLMatcher.validate_grammar(spec, tok)
        if error:
            raise ValueError(f"structured_outputs.{so.kind} is invalid: {error.strip()}")
        return spec

    def attach(self, seqs: list[Sequence], spec: str) -> None:
        llg, tok, _ = self._llg
        for seq in seqs:
            seq.grammar = llg.LLMatcher(tok, spec, log_level=0)

    def start(self, targets: list[Sequence]) -> PendingMasks | None:
        """Begin computing the masks of the constrained sequences among targets."""
        indices = [j for j, s in enumerate(targets) if s.grammar is not None]
        if not indices:
            return None
        llg, tok, executor = self._llg
        matchers = [(targets[j].grammar, k) for k, j in enumerate(indices)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")

        def fill() -> torch.Tensor:
            start = time.perf_counter()
            bitmask = torch.full((len(indices), (tok.vocab_size + 31) // 32), -1,
                                 dtype=torch.int32)
            executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(),
                                             bitmask.shape[1] * 4, len(indices))
            self.mask_rows += len(indices)
            self.mask_seconds += time.perf_counter() - start
            return bitmask

        return PendingMasks(indices, self._pool.submit(fill), self)

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> str | None:
        """Feed a sampled token to seq's matcher; "stop" when the grammar is complete."""
        matcher = seq.grammar
        if not matcher.consume_token(token_id):
            logger.warning("sequence %s: token %d does not match its grammar (%s); stopping",
                           seq.seq_id, token_id, matcher.get_error())
            return "stop"
        return "stop" if matcher.is_stopped() else None

