"""Request: one prompt with its n sequences, their text (streaming detokenization and stop
strings), stop checks and timing metrics; builds the RequestOutput the user sees."""

from __future__ import annotations

from tokenmill.engine.sequence import Sequence
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceText:
    """Text of one sequence. While running, the last (longest stop string - 1) characters are
    held back from streams, so a stop string split across tokens is never shown and then
    taken back."""

    def __init__(self, tokenizer: Tokenizer | None, seq: Sequence) -> None:
        p = seq.params
        self.detok = (
            IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens)
            if tokenizer else None
        )
        self.text = ""
        self.holdback = max((len(s) for s in p.stop_strings), default=1) - 1
        self.emitted_chars = 0
        self.emitted_tokens = 0

    def add(self, token_id: int, params: SamplingParams, check_stop: bool) -> str | None:
        """Append the token's text; return the stop string that ended the text, if any."""
        if self.detok is None:
            return None
        delta = self.detok.step(token_id)
        if not delta:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        if not check_stop:
            return None
        for stop in params.stop_strings:
            at = self.text.find(stop, start)
            if at != -1:
                end = at + len(stop) if params.include_stop_str_in_output else at
                self.text = self.text[:end]
                return stop
        return None

    def finish(self, stopped_by_string: bool) -> None:
        if self.detok is not None and not stopped_by_string:
            self.text += self.detok.flush()

    def visible(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[: max(self.emitted_chars, len(self.text) - self.holdback)]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_token_ids: list[int],
        max_model_len: int,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.seqs = [
            Sequence(prompt_token_ids, params.for_child(i), request_id, i) for i in range(params.n)
        ]
        self.seqs[0].group_size = params.n
        self.pending_children = self.seqs[1:]  # forked from seqs[0] when its prompt is done
        self.texts = {s.seq_id: SequenceText(tokenizer, s) for s in self.seqs}
        self.metrics = RequestMetrics(arrival_time, num_prompt_tokens=len(prompt_token_ids))

    @property
    def parent(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def append_token(self, seq: Sequence, token_id: int, logprobs) -> str | None:
        """Add a sampled token to seq; return the finish reason if seq is now done."""
        p = seq.params
        seq.append_token(token_id)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in p.stop_token_set:
            seq.stop_reason = token_id
            return "stop"
        text = self.texts[seq.seq_id]
        stop = text.add(token_id, p, check_stop=seq.num_output_tokens >= p.min_tokens)
        if stop is not None:
            seq.stop_reason = stop
            return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def on_finish(self, seq: Sequence) -> None:
        self.texts[seq.seq_id].finish(isinstance(seq.stop_reason, str))

    def output(self) -> RequestOutput:
        """A snapshot; delta_* fields hold what is new since the previous snapshot."""
        completions = []
        for seq in self.seqs:
            text = self.texts[seq.seq_id]
            visible = text.visible(seq.is_finished)
            tokens = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index,
                text=visible,
                token_ids=tokens,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=self._named(seq.logprobs) if seq.params.logprobs is not None else None,
                delta_text=visible[text.emitted_chars :],
                delta_token_ids=tokens[text.emitted_tokens :],
            ))
            text.emitted_chars, text.emitted_tokens = len(visible), len(tokens)
        parent = self.parent
        prompt_lp = None
        if self.params.prompt_logprobs is not None:
            prompt_lp = [None] + self._named(parent.prompt_logprobs[1:])
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=prompt_lp,
        )

    def _named(self, entries: list) -> list:
        """Fill in decoded_token for logprob entries (once; entries are shared objects)."""
        if self.tokenizer is not None:
            for entry in entries:
                for token_id, lp in (entry or {}).items():
                    if lp.decoded_token is None:
                        lp.decoded_token = self.tokenizer.token_text(token_id)
        return list(entries)
