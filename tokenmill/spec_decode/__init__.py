"""Speculative decoding: proposers draft tokens for decoding sequences, the target model
verifies all drafts of a step in one forward pass (engine/model_runner.py: one decode row per
draft; layers/rejection_sampler.py: exact acceptance). A proposer is one file and one entry in
PROPOSERS: a class built from the SpeculativeConfig with propose(seqs, lengths) -> [Proposal]
(spec_decode/proposal.py) and finished(seqs)."""

from __future__ import annotations

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.suffix import SuffixProposer


def _draft_model(config, **kwargs):
    from tokenmill.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, **kwargs)


PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer, "draft_model": _draft_model}

__all__ = ["PROPOSERS", "SpeculativeConfig"]
