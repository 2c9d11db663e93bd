"""The offline Python API, with vLLM's names: LLM(...).generate / .chat / .stream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """LLM(model, dtype=..., quantization=..., max_model_len=..., max_num_seqs=...,
    max_num_batched_tokens=...,
    block_size=..., enable_prefix_caching=True, kv_cache_memory=..., ...)."""

    def __init__(self, model: str, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's LLM.get_tokenizer)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> dict:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        text = tok.apply_chat_template(messages, add_generation_prompt, chat_template)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each time the request gets new tokens; print .delta_text.
        Closing the generator early aborts the request and frees its KV blocks."""
        rid = self.engine.add_request(None, prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)
