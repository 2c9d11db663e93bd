"""Draft-model proposer: a second model that shares the target's vocabulary drafts k tokens per
sequence, run by the engine's own parts (a ModelRunner with its own paged KV cache and block
pool). Each draft sequence mirrors its target sequence's verified tokens: before drafting it is
cut back to what the two have in common (rejected drafts' K/V are then overwritten), catches up
on the tokens the target accepted in one batched step, then drafts one token per step for all
sequences together. Greedy requests draft greedily; sampled ones sample from the draft's
distribution under the request's temperature / top-k / top-p / min-p, returned with the drafts
so verification can accept with min(1, p / q)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.cache_config import plan_kv_cache
from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.sequence import Sequence
from tokenmill.layers import ops
from tokenmill.layers.sampler import Sampler, SamplingMetadata
from tokenmill.loaders import load_model
from tokenmill.loaders.resolve import read_model_config, resolve_model
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposal import Proposal

logger = logging.getLogger("tokenmill")
DRAFT_SEED_OFFSET = 0x5EED  # a seeded request's drafts use seed + this (not its own stream)


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig,
                 vocab_size: int, device: torch.device, **_) -> None:
        path = resolve_model(config.model)
        read_model_config(path)
        backend = ops.select(engine_config.use_kernels, device)
        self.model, mc, dtype = load_model(path, config.dtype, device,
                                           engine_config.max_model_len, backend,
                                           config.quantization)
        if mc.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({mc.vocab_size} tokens) differs "
                             f"from the target's ({vocab_size}): a draft must share it")
        draft_cfg = replace(engine_config, model=path, dtype=config.dtype,
                            quantization=config.quantization, enable_prefix_caching=False,
                            max_model_len=min(engine_config.max_model_len,
                                              mc.max_position_embeddings),
                            kv_cache_dtype="auto", kv_cache_memory=None)
        plan = plan_kv_cache(draft_cfg, mc, dtype, device)
        self.max_len = plan.max_model_len
        self.kv = KVCacheManager(list(plan.groups), plan.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, mc, plan.groups, plan.block_size, plan.kv_dtype,
                                  device, engine_config.seed, backend=backend)
        self.runner.prepare_weights()
        self.sampler = Sampler(device, engine_config.seed + 1, backend)
        self.device = device
        self.mirrors: dict[int, Sequence] = {}
        logger.info("draft model %s: %s", config.model, plan.describe())

    # ---- the proposer's interface -------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lengths: list[int]):
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        active = [(s, self._sync(s), k) for s, k in zip(seqs, lengths)]
        active = [(s, m, k) for s, m, k in active if m is not None]
        for step in range(max((k for *_, k in active), default=0)):
            active = [(s, m, k) for s, m, k in active if k > step and self._reserve(s, m)]
            if not active:
                break
            tokens, q = self._draft_step([s for s, *_ in active], [m for _, m, _ in active])
            for (s, m, _), t, row in zip(active, tokens, q):
                m.num_computed_tokens = m.num_tokens
                m.append_token(t)
                drafts[s.seq_id].append(t)
                if row is not None:
                    probs[s.seq_id].append(row)
        return [Proposal(drafts[s.seq_id], torch.stack(probs[s.seq_id]) if probs[s.seq_id]
                         else None) for s in seqs]

    def finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            mirror = self.mirrors.pop(seq.seq_id, None)
            if mirror is not None:
                self.kv.free(mirror)

    # ---- internals ----------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence | None:
        """The draft's copy of seq, cut back to the tokens both agree on."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(seq.token_ids, seq.params)
            if seq.params.seed is not None:  # seeded requests draft reproducibly too
                mirror.generator = torch.Generator(self.device).manual_seed(
                    (seq.params.seed + DRAFT_SEED_OFFSET) % 2**63)
        else:
            common = 0
            for a, b in zip(mirror.token_ids, seq.token_ids):
                if a != b:
                    break
                common += 1
            mirror.token_ids = list(seq.token_ids)
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, common)
            self.kv.truncate(mirror)  # (no prefix caching here: no block is ever hashed)
        return mirror

    def _reserve(self, seq: Sequence, mirror: Sequence) -> bool:
        """Blocks for the mirror's uncomputed tokens; a sequence that does not fit (or would
        pass the draft's length limit) stops drafting and lets its blocks go."""
        n = mirror.num_uncomputed_tokens
        if mirror.num_tokens < self.max_len and self.kv.can_allocate(mirror, n):
            self.kv.allocate(mirror, n)
            return True
        self.finished([seq])
        return False

    def _draft_step(self, seqs: list[Sequence], mirrors: list[Sequence]):
        """One forward pass of the draft over every mirror's uncomputed tokens; one token each
        (and, for sampled requests, the distribution it was drawn from)."""
        scheduled = [(m, m.num_uncomputed_tokens) for m in mirrors]
        prepared = self.runner.prepare(scheduled)
        last = [prepared[3][i] + n - 1 for i, (_, n) in enumerate(scheduled)]
        rows = sorted(last)  # each mirror's last row: the last layer runs on those alone
        logits = self.runner.run(scheduled, rows, prepared)
        if rows != last:
            where = {r: k for k, r in enumerate(rows)}
            logits = logits[torch.tensor([where[r] for r in last], device=self.device)]
        params = [s.params for s in seqs]
        tokens = self.runner.ops.argmax(logits)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        q: list[torch.Tensor | None] = [None] * len(seqs)
        if sampled:
            meta = SamplingMetadata([params[i].temperature for i in sampled],
                                    [params[i].top_k for i in sampled],
                                    [params[i].top_p for i in sampled],
                                    [params[i].min_p for i in sampled],
                                    [mirrors[i].generator for i in sampled],
                                    logprobs=[None] * len(sampled))
            probs = self.sampler.probs(logits[sampled], meta)
            tokens[sampled] = self.sampler.draw(probs, meta.generators)
            for j, i in enumerate(sampled):
                q[i] = probs[j]
        return tokens.tolist(), q
