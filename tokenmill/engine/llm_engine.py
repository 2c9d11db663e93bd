"""LLMEngine: add_request / step / abort_request. One step = schedule, run the model, append
sampled tokens, check stops, free finished sequences, and report RequestOutputs."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import replace

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.cache_config import plan_kv_cache, resolve_device
from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.memory import (
    MemoryReport,
    available_memory,
    check_kv_budget,
    check_model_fits,
    peak_rss,
    reset_peak_rss,
    rss,
)
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request
from tokenmill.engine.request_checks import check_params, check_prompt, prompt_ids
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.spec_decode import SpecDecoder, measure_step_cost
from tokenmill.engine.startup import Stopwatch
from tokenmill.engine.structured import StructuredOutputs
from tokenmill.engine.thread_governor import ThreadGovernor
from tokenmill.host_memory import keep_freed_memory, release_freed_memory
from tokenmill.layers import ops
from tokenmill.loaders import load_model
from tokenmill.loaders.resolve import load_tokenizer, read_model_config, resolve_model
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        clock = Stopwatch()
        self.device = resolve_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        reset_peak_rss()
        path = resolve_model(config.model)
        check_model_fits(path, self.device)
        if config.kv_cache_memory is not None:  # refused before kernels build, weights load
            check_kv_budget(config.kv_cache_memory, self.device)
        read_model_config(path)  # a GGUF's metadata is parsed once, here, and reused by the loaders
        clock.lap("metadata")
        backend = ops.select(config.use_kernels, self.device, config.deterministic)
        clock.lap("kernel library")
        rss_before_weights = rss()
        self.tp = None
        if config.tensor_parallel_size > 1:
            model, self.model_config, self.dtype, plan = self._load_sharded(path, backend, config)
        else:
            model, self.model_config, self.dtype = load_model(
                path, config.dtype, self.device, config.max_model_len, backend,
                config.quantization)
            plan = None
        clock.lap("weights")
        self.tokenizer = load_tokenizer(config.tokenizer or path, self.model_config)
        clock.lap("tokenizer")
        plan = plan or plan_kv_cache(config, self.model_config, self.dtype, self.device)
        self.config = config = replace(
            config, block_size=plan.block_size, max_model_len=plan.max_model_len,
            max_num_batched_tokens=plan.max_num_batched_tokens,
        )
        self.kv_plan = plan
        logger.info(plan.describe())
        self.eos_token_ids = list(
            self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        )
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.eos_token_ids)
        self.kv_manager = KVCacheManager(
            list(plan.groups), config.block_size, config.enable_prefix_caching
        )
        self.block_manager = self.kv_manager.primary  # the only pool of most models
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(
            model, self.tp.group.shard.local if self.tp else self.model_config, plan.groups,
            config.block_size, plan.kv_dtype, self.device, config.seed, self.eos_token_ids,
            backend,
        )
        self.runner.tp_driver = self.tp
        self.governor = ThreadGovernor.for_engine(self.device, config.deterministic,
                                                  self.tp is not None)
        weakref.finalize(self, self.governor.restore)  # the process's threads back when done
        clock.lap("kv cache")
        self.runner.prepare_weights()
        if self.device.type == "cpu":
            release_freed_memory()  # the load's temporaries (see host_memory)
        clock.lap("packing")
        self.spec = None
        if (spec := config.speculative_config) is not None:
            cost = measure_step_cost(self.runner, self.kv_manager, config.max_num_seqs * (
                spec.num_speculative_tokens + 1)) if spec.adaptive else None
            self.spec = SpecDecoder(spec, config.max_model_len, cost, engine_config=config,
                                    vocab_size=self.model_config.vocab_size, device=self.device)
            clock.lap("speculative decoding")
        self.startup = clock
        logger.info("ops: %s; %s", backend.name, clock.describe())
        self.memory = MemoryReport(
            model=max(0, rss() - rss_before_weights),
            kv_budget=plan.nbytes, kv_tokens=plan.num_tokens,
            kv_bytes_per_token=plan.bytes_per_token, max_model_len=plan.max_model_len,
            rss=rss(), peak_rss=peak_rss(), available=available_memory(self.device))
        logger.info(self.memory.describe())
        self.requests: dict[str, Request] = {}
        self._counter = 0

    def _load_sharded(self, path: str, backend, config: EngineConfig):
        """Rank 0's shard; the other ranks (started here) load theirs at the same time. The
        KV cache plan is made here, from the whole model, and shared."""
        from tokenmill.distributed.executor import TPDriver
        from tokenmill.distributed.sharding import local_config
        from tokenmill.distributed.worker import Setup, load_shard
        from tokenmill.loaders import resolve_dtype

        model_config = read_model_config(path)
        local_config(model_config, config.tensor_parallel_size)  # refuse before spawning
        with ops.building(backend):  # resolve_dtype asks which op implementation builds
            dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        plan = plan_kv_cache(config, model_config, dtype, self.device)
        config = replace(config, block_size=plan.block_size)
        setup = Setup(config, path, model_config, plan.groups, plan.kv_dtype,
                      config.max_model_len)
        self.tp = TPDriver(config, config.parallel, self.device)
        self.tp.setup(setup)
        model, dtype = load_shard(self.tp.group, config, setup, self.device, backend)
        self.tp.ready()
        return model, model_config, dtype, plan

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A string, {"prompt_token_ids": [...]}, or {"prompt": "..."} -> (text, token ids)."""
        return prompt_ids(prompt, self.tokenizer)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self._validate_prompt(ids)
        check_params(params, self.model_config.vocab_size)
        grammar = self.structured.check(params)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.config.max_num_seqs}), "
                             f"got {params.n}")
        req = Request(request_id, text, ids, params, self.tokenizer, self.eos_token_ids,
                      self.config.max_model_len, arrival_time or time.perf_counter())
        if grammar is not None:
            self.structured.attach(req.seqs, grammar)
        self.requests[request_id] = req
        self.scheduler.add(req.parent)
        return request_id

    def _validate_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.model_config.vocab_size, self.config.max_model_len)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        req.pending_children = []
        if self.spec is not None:
            self.spec.finished(req.seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit); give the process its
        threads back if the governor took some."""
        self.governor.restore()
        if self.tp is not None:
            self.tp.shutdown()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts for decoding sequences
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        decode_only = all(s.runs_as_decode(n) for s, n in sched.scheduled)
        now = time.perf_counter()
        rows, targets = self._sample_plan(sched.scheduled, now)
        masks = self.structured.start(targets)  # computed while the model runs
        with self.governor.step():  # fewer threads while the CPU is shared
            result = self.runner.execute(sched.scheduled, rows, targets, masks)
        now = time.perf_counter()
        for seq, n in sched.scheduled:
            if seq.spec_token_ids:
                continue  # its counter moves once its drafts are verified (below)
            seq.num_computed_tokens += n
            self.kv_manager.commit(seq)  # prefix-cache new full blocks, free slid-out ones
            entries = result.prompt_logprobs.get(seq.seq_id)
            if entries:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)
                seq.prompt_logprobs += entries
        touched: dict[str, Request] = {}
        for seq in targets:
            req = self.requests[seq.request_id]
            if seq in req.pending_children:
                req.pending_children.remove(seq)
                self.kv_manager.fork(req.parent, seq)
                self.scheduler.add_running(seq)
        for seq, tokens, logprobs, accepted in zip(targets, result.token_ids, result.logprobs,
                                                   result.num_accepted):
            req = touched.setdefault(seq.request_id, self.requests[seq.request_id])
            reason = None
            for token, lp in zip(tokens, logprobs):
                reason = req.append_token(seq, token, lp)
                if reason is None and seq.grammar is not None:
                    reason = self.structured.accept(seq, token)
                if reason is not None:
                    break  # tokens after a stop are dropped
            if seq.spec_token_ids:
                self._verified(seq, req, accepted)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                req.on_finish(seq)
        outputs = []
        for req in touched.values():
            m = req.metrics
            m.first_token_time = m.first_token_time or now
            m.token_times.append(now)
            m.num_output_tokens = max(s.num_output_tokens for s in req.seqs)
            if req.finished:
                m.finished_time = now
                del self.requests[req.request_id]
                if self.spec is not None:
                    self.spec.finished(req.seqs)
            outputs.append(req.output())
        if self.spec is not None and decode_only:
            self.spec.observe_step(sched.num_batched_tokens, len(sched.scheduled),
                                   time.perf_counter() - start)
        return outputs

    def _verified(self, seq: Sequence, req: Request, accepted: int) -> None:
        """After a verify step: the last token and the accepted drafts have K/V (the new last
        token does not); rejected drafts' slots are rolled back."""
        self.spec.record(seq, req.metrics, len(seq.spec_token_ids), accepted)
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv_manager.truncate(seq)
        self.kv_manager.commit(seq)

    def _sample_plan(self, scheduled, now) -> tuple[list[int], list[Sequence]]:
        """Which scheduled entries sample a token this step, and for which sequences."""
        rows, targets = [], []
        for i, (seq, n) in enumerate(scheduled):
            req = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prompt chunk that is not the last one
            rows.append(i)
            targets.append(seq)
            if seq is req.parent and req.pending_children:
                rows += [i] * len(req.pending_children)
                targets += req.pending_children
        return rows, targets

    @torch.inference_mode()
    def compute_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Logits (tokens, vocab) at every position of token_ids, computed through the paged
        KV cache in chunks (for scoring, perplexity and tests), each cut to what the free
        blocks (and int4's stage slots) hold, as the scheduler cuts them. Blocks are freed
        afterwards."""
        self._validate_prompt(token_ids[:-1] or token_ids)
        seq = Sequence(token_ids, SamplingParams(max_tokens=1))
        chunk = chunk_size or self.config.max_num_batched_tokens
        logits = []
        try:
            while seq.num_computed_tokens < seq.num_tokens:
                n = min(chunk, seq.num_uncomputed_tokens)
                while n > 1 and not self.kv_manager.can_allocate(seq, n):
                    n //= 2
                if not self.kv_manager.can_allocate(seq, n):
                    raise RuntimeError("not enough free KV blocks to score this sequence")
                self.kv_manager.allocate(seq, n)
                logits.append(self.runner.run([(seq, n)], range(n)))
                seq.num_computed_tokens += n
                self.kv_manager.commit(seq)
        finally:
            self.kv_manager.free(seq)
        return torch.cat(logits)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.kv_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "kv_cache_used_bytes": bm.used_bytes,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.primary.num_queried_tokens,
            "prefix_cache_hits": bm.primary.num_hit_tokens,
            **(self.spec.stats() if self.spec is not None else {}),
        }

