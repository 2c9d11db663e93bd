"""ModelRunner: owns the model and the paged KV cache; turns a scheduled step into tensors,
runs the forward pass and samples.

Tokens of a step are packed decode-first: sequences computing exactly one token form the
decode batch, then each multi-token (prefill) chunk follows. A sequence verifying drafted
tokens (speculative decoding) is 1 + drafts decode rows at consecutive positions: every row
reads the paged cache like a decode token, and its logits score the next draft.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.engine.kv_manager import CacheGroup
from tokenmill.engine.sampling_metadata import sampling_metadata
from tokenmill.engine.sequence import Sequence
from tokenmill.host_memory import release_freed_memory
from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionContext, PrefillChunk
from tokenmill.layers.kv_cache import KVCache
from tokenmill.layers.kv_quant import kv_format
from tokenmill.layers.linear import drop_row_copies
from tokenmill.layers.rejection_sampler import Span, verify
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.sampler import GrammarMasks, Sampler, top_logprobs
from tokenmill.layers.slot_cache import PooledChunk, PooledContext, SlotCache
from tokenmill.models.config import ModelConfig

logger = logging.getLogger("tokenmill")


@dataclass
class StepResult:
    token_ids: list[list[int]]  # per sampled sequence, in the order asked: its new tokens
    logprobs: list[list]  # per sampled sequence, per new token: dict[id, Logprob] or None
    num_accepted: list[int] = field(default_factory=list)  # per sampled sequence: drafts kept
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # seq_id -> new entries


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        groups: tuple[CacheGroup, ...],
        block_size: int,
        kv_dtype: str,
        device: torch.device,
        seed: int = 0,
        eos_ids: list[int] = (),
        backend: ops.TorchOps | None = None,
    ) -> None:
        self.ops = backend or ops.current()  # the op implementation the model was built with
        self.model = model
        # rotary tables, computed as far as the steps' positions reach (layers/rotary.py)
        self._rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        self.config = model_config
        self.device = device
        self.block_size = block_size
        self.pooled = groups[0].widths is not None  # DeepSeek V4: layers/slot_cache.py
        self.kv_caches = [  # one per block pool (see engine/kv_manager.py)
            SlotCache(g.widths, g.num_blocks, g.slots_per_block or block_size,
                      kv_format(kv_dtype).dtype, device) if self.pooled else
            KVCache(len(g.layers), g.num_blocks, block_size, model_config.num_key_value_heads,
                    model_config.kv_latent_dim or model_config.head_dim, kv_dtype, device,
                    latent=bool(model_config.kv_latent_dim), stage_slots=g.stage_slots,
                    stage_dtype=getattr(torch, g.stage_dtype)) for g in groups
        ]
        self.kv_cache = self.kv_caches[0]
        self._check_invariant_caches()
        self.eos_ids = list(eos_ids)
        self.sampler = Sampler(device, seed, self.ops)
        self.tp_driver = None  # distributed/executor.py TPDriver: ranks to tell each step

    def _check_invariant_caches(self) -> None:
        """Batch-invariant ops read a quantized cache only through the kernels: refuse one
        they do not read at start, not at the first step."""
        from tokenmill.kernels.kv_pages import supports
        from tokenmill.layers.batch_invariant import BatchInvariantOps

        invariant = isinstance(self.ops, BatchInvariantOps)
        for cache in self.kv_caches:
            if invariant and getattr(cache, "quantized", False) and not supports(cache):
                raise ValueError(f"deterministic mode reads a {cache.format.name} KV cache with "
                                 f"the kernels, which need head_dim a multiple of 32 up to 256 "
                                 f"(and a float32 or bfloat16 model); this model has head_dim "
                                 f"{cache.head_dim}")

    def prepare_weights(self) -> None:
        """Pack every linear layer's weight (and plan its GEMMs and prefill attention) now, not
        in the first step."""
        dropped = drop_row_copies(self.model, release_freed_memory)
        if dropped:
            logger.info("weights: %.1f MiB of row-major copies freed (the kernels read their "
                        "packed panels)", dropped / 2**20)
        cfg, cache = self.config, self.kv_cache
        if self.pooled:
            return
        if not cache.quantized and not cache.latent and cache.format.dtype in ops.KERNEL_DTYPES:
            self.ops.prepare_attention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, cache.format.dtype)

    @property
    def kernels(self) -> bool:
        """Whether the C++ kernels run this model (else the PyTorch reference ops)."""
        from tokenmill.layers.kernel_ops import KernelOps

        return isinstance(self.ops, KernelOps)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Packed input ids, positions and the AttentionContext; plus, per scheduled entry,
        the index of its first token in the packed batch."""
        order = [i for i, (seq, n) in enumerate(scheduled) if seq.runs_as_decode(n)]
        num_decodes = sum(scheduled[i][1] for i in order)
        order += [i for i, (seq, n) in enumerate(scheduled) if not seq.runs_as_decode(n)]
        ids, positions, starts = [], [], [0] * len(scheduled)
        for i in order:
            seq, n = scheduled[i]
            first = seq.num_computed_tokens
            starts[i] = len(ids)
            ids += seq.step_token_ids(first, n)
            positions += range(first, first + n)
        if positions:
            reach = max(seq.num_computed_tokens + n for seq, n in scheduled)
            for rotary in self._rotary:
                rotary.ensure(reach)
        ids, positions = self._tensor([ids, positions])  # one conversion, two row views
        if self.pooled:
            return ids, positions, self._pooled_context(scheduled, order, starts), starts
        ctxs = [self._group_context(g, scheduled, order, num_decodes, starts)
                for g in range(len(self.kv_caches))]
        ctx = ctxs[0]
        ctx.window_ctx = ctxs[1] if len(ctxs) > 1 else None
        ctx.prompt_rows = _prompt_rows(scheduled, order, starts)
        return ids, positions, ctx, starts

    def _group_context(self, group: int, scheduled, order, num_decodes, starts):
        """Slots and block tables of one block pool's cache (a staged cache: stage rows and
        slots too, kv_cache.py)."""
        bs, staged = self.block_size, self.kv_caches[group].staged
        slots, stage_rows, prefills = [], [], []
        for i in order:
            seq, n = scheduled[i]
            first, table = seq.num_computed_tokens, seq.block_tables[group]
            slots += [table[p // bs] * bs + p % bs for p in range(first, first + n)]
            stages = seq.stage_tables[group] if staged else None
            if staged:
                stage_rows += [stages[p // bs] * bs + p % bs for p in range(first, first + n)]
            if not seq.runs_as_decode(n):
                prefills.append(PrefillChunk(starts[i], starts[i] + n, first, self._tensor(table),
                                             self._tensor(stages) if staged else None))
        tables, lens, own = [], [], []
        if num_decodes:  # one row per decode token; a verify step's rows see one more each
            for seq, n in (scheduled[i] for i in order):
                if not seq.runs_as_decode(n):
                    continue
                tables += [seq.block_tables[group]] * n
                first = seq.num_computed_tokens
                lens += range(first + 1, first + n + 1)
                if staged:
                    own += [seq.stage_tables[group][p // bs] for p in range(first, first + n)]
        index = self._tensor(slots + lens)  # one conversion: slots, then lens
        ctx = AttentionContext(self.kv_caches[group], index[:len(slots)], num_decodes,
                               prefills=prefills)
        if staged:
            ctx.stage_mapping = self._tensor(stage_rows)
        if num_decodes:
            # NULL_BLOCK (-1, slid out of the window) indexes the last block: read but masked.
            width = max(len(t) for t in tables)
            ctx.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in tables])
            ctx.decode_seq_lens = index[len(slots):]
            if staged:
                ctx.decode_stages = self._tensor(own)
        return ctx

    def _pooled_context(self, scheduled, order, starts) -> PooledContext:
        chunks, slots = [], []
        for i in order:
            seq, n = scheduled[i]
            first = seq.num_computed_tokens
            chunks.append(PooledChunk(starts[i], starts[i] + n, first, seq.block_tables))
            slots.append(self.kv_caches[0].slots(seq.block_tables[0], first, first + n))
        return PooledContext(self.kv_caches, chunks, torch.cat(slots))

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        keep = ctx.rows_to_keep(len(input_ids)) if hasattr(ctx, "rows_to_keep") else None
        with self.ops.prompt_rows(getattr(ctx, "prompt_rows", None), len(input_ids), keep):
            return self.model(input_ids, positions, ctx)

    def run(self, scheduled, rows, prepared=None) -> torch.Tensor | None:
        """The forward pass of a step and the logits of the packed rows `rows` (None if
        there are none). Under tensor parallelism the step plan goes to every rank first, and
        each runs this same call on its shard."""
        if self.tp_driver is not None:
            self.tp_driver.step(scheduled, list(rows))
        input_ids, positions, ctx, _ = prepared or self.prepare(scheduled)
        rows = list(rows)
        if hasattr(ctx, "output_rows") and all(a < b for a, b in zip(rows, rows[1:])):
            ctx.output_rows = rows  # a model may run its last layer on these rows alone
        hidden = self.forward(input_ids, positions, ctx)
        if not len(rows):
            return None
        # the rows alone came back (the model kept ctx.output_rows), or all of the step's did
        if getattr(ctx, "output_rows", None) != rows or hidden.shape[0] != len(rows):
            hidden = hidden[self._tensor(rows)]
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        sample_rows: list[int],
        sample_seqs: list[Sequence],
        masks=None,
    ) -> StepResult:
        """Run one step. sample_rows[j] is the scheduled entry whose last token's logits sample
        a token for sample_seqs[j] (several entries may share a row: n > 1 forks). masks: the
        structured-output masks of some sample_seqs (engine/structured.py PendingMasks), still
        being computed."""
        prepared = self.prepare(scheduled)
        starts = prepared[3]
        spans = []  # per sampled sequence: its rows (a verify step has one per draft, + 1)
        for i, seq in zip(sample_rows, sample_seqs):
            owner, n = scheduled[i]
            drafts = seq.spec_token_ids if seq is owner else []
            spans.append(Span(starts[i] + n - 1 - len(drafts), drafts,
                              seq.spec_draft_probs if drafts else None))
        sample_at = [s.first + j for s in spans for j in range(len(s.drafts) + 1)]
        plp_rows, plp_plan = self._prompt_logprob_rows(scheduled, starts)
        rows = sorted(set(sample_at) | set(plp_rows))
        where = {r: k for k, r in enumerate(rows)}
        logits = self.run(scheduled, rows, prepared)
        result = StepResult([], [])
        if sample_seqs:  # rows in sampling order (no copy when they already are)
            order = [where[r] for r in sample_at]
            sample_logits = logits if order == list(range(len(rows))) else logits[
                self._tensor(order)]
            result = self._sample(sample_logits, spans, sample_seqs, masks)
        for seq, positions_, first_row in plp_plan:
            lp = logits[self._tensor([where[r] for r in positions_])].log_softmax(-1)
            k = seq.params.prompt_logprobs
            entries = [top_logprobs(lp[j], k, seq.token_ids[first_row + j + 1])
                       for j in range(len(positions_))]
            result.prompt_logprobs[seq.seq_id] = entries
        return result

    def _sample(self, logits: torch.Tensor, spans: list[Span], seqs: list[Sequence],
                masks=None) -> StepResult:
        if not any(s.drafts for s in spans):  # one row, one token per sequence
            meta = sampling_metadata(seqs, self.eos_ids, self.device)
            if masks is not None:
                meta.grammar = GrammarMasks(masks.indices, masks.bitmask())
            out = self.sampler(logits, meta)
            return StepResult([[t] for t in out.token_ids], [[lp] for lp in out.logprobs],
                              [0] * len(seqs))
        row_seqs, offsets, rebased = [], [], []
        for span, seq in zip(spans, seqs):
            rebased.append(Span(len(row_seqs), span.drafts, span.draft_probs))
            row_seqs += [seq] * (len(span.drafts) + 1)
            offsets += range(len(span.drafts) + 1)
        meta = sampling_metadata(row_seqs, self.eos_ids, self.device, offsets)
        if masks is not None:  # constrained sequences have no drafts: one row each
            meta.grammar = GrammarMasks([rebased[j].first for j in masks.indices],
                                        masks.bitmask())
        out = verify(self.sampler, logits, meta, rebased)
        return StepResult(out.token_ids, out.logprobs, out.num_accepted)

    def _prompt_logprob_rows(self, scheduled, starts):
        """Rows whose logits score the next prompt token, for sequences that want prompt
        logprobs. A chunk covering positions [c, c+n) scores prompt tokens c+1 .. c+n."""
        rows, plan = [], []
        for i, (seq, n) in enumerate(scheduled):
            if not seq.wants_prompt_logprobs:
                continue
            first = seq.num_computed_tokens
            done = len(seq.prompt_logprobs)  # entries already recorded (0 = none yet)
            lo = max(first, done - 1 if done else 0)
            hi = min(first + n, seq.num_prompt_tokens - 1)  # positions whose next token is prompt
            if hi <= lo:
                continue
            positions_ = [starts[i] + p - first for p in range(lo, hi)]
            rows += positions_
            plan.append((seq, positions_, lo))
        return rows, plan


# Prompts from this many tokens send their prompt rows to ops.prompt_rows. A quantized GEMM's
# prompt path dequantizes every weight once per call whatever its rows; on the AMX Xeon it
# measured: 16-24-token prompts 2-3 ms slower (of 6-9), 32 level, 128 1.5x faster.
PROMPT_ROWS_FROM = 48


def _prompt_rows(scheduled, order, starts) -> list[tuple[int, int]]:
    """The packed rows of prompt tokens in a step's prefill chunks (ascending, adjacent ones
    merged), of prompts of at least PROMPT_ROWS_FROM tokens. The request and a token's own
    position decide, so a prompt's rows are the same however it is chunked and whatever runs
    beside it, while generated tokens (decode and verify rows, a preempted sequence's
    recomputed output) stay the others."""
    ranges = []
    for i in order:
        seq, n = scheduled[i]
        if seq.runs_as_decode(n) or seq.num_prompt_tokens < PROMPT_ROWS_FROM:
            continue
        k = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        if k <= 0:
            continue
        if ranges and ranges[-1][1] == starts[i]:
            ranges[-1] = (ranges[-1][0], starts[i] + k)
        else:
            ranges.append((starts[i], starts[i] + k))
    return ranges
