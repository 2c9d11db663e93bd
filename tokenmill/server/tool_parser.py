"""Tool calls out: the model's `<tool_call>{json}</tool_call>` blocks (Hermes' format, see
tool_prompt.py) parsed into OpenAI tool_calls, for whole responses and, as the text grows,
for streams: content deltas until a block opens; then, once `{"name": ..., "arguments": ` is
written, a delta with the call's id and name, and its arguments' text in pieces as it comes
(the last few characters held back: they may be the wrapper's closing brace). A block that is
not JSON with a name stays content, as the model wrote it (in a stream, only if its name was
not announced yet)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.server.protocol import FunctionCall, ToolCall, ToolCallDelta
from tokenmill.server.tool_prompt import CLOSE, OPEN

BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)
HEADER = re.compile(re.escape(OPEN) + r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                    r'"arguments"\s*:\s*')
HOLD = len("}\n" + CLOSE)  # characters of a growing block that may not be arguments


def _to_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"],
                                          arguments=json.dumps(args, ensure_ascii=False)))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls, or None if there is none; the calls)."""
    calls, kept, last = [], [], 0
    for m in BLOCK.finditer(text):
        call = _to_call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


@dataclass
class _Open:
    """The call being streamed: where its arguments start in the block, how much was sent."""

    call: ToolCall
    args_start: int
    sent: int = 0


class ToolCallStream:
    """Feed it each text delta; it returns (content delta, tool-call deltas). Text that might
    be the start of `<tool_call>` is held back until it is known not to be."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet emitted: a possible block opening, or a block
        self.calls: list[ToolCall] = []
        self.open: _Open | None = None

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.pending += delta
        content, deltas = "", []
        while self.pending:
            at = self.pending.find(OPEN)
            if at == -1:
                keep = 0 if final else _partial_open(self.pending)
                content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            content += self.pending[:at]
            self.pending = self.pending[at:]
            end = self.pending.find(CLOSE)
            if end == -1 and not final:
                deltas += self._growing()
                break  # the block is still being written
            block = self.pending if end == -1 else self.pending[:end + len(CLOSE)]
            self.pending = "" if end == -1 else self.pending[end + len(CLOSE):]
            body = block[len(OPEN):len(block) - (0 if end == -1 else len(CLOSE))]
            if self.open is not None:  # announced: send the rest of its arguments
                deltas.append(self._rest(block, end != -1))
                continue
            call = _to_call(body)
            if call is None:
                content += block
                continue
            deltas.append(ToolCallDelta(index=len(self.calls), id=call.id, type="function",
                                        function=call.function))
            self.calls.append(call)
        if self.calls and not content.strip():  # the newlines between calls
            content = ""
        return content, deltas


    def _growing(self) -> list[ToolCallDelta]:
        """Deltas for the unfinished block at the start of pending: the call's name once its
        header is complete, then its arguments as far as they are surely arguments."""
        out = []
        if self.open is None:
            m = HEADER.match(self.pending)
            if m is None:
                return out
            call = ToolCall(function=FunctionCall(name=json.loads(m.group(1)), arguments=""))
            self.open = _Open(call, m.end())
            self.calls.append(call)
            out.append(ToolCallDelta(index=len(self.calls) - 1, id=call.id, type="function",
                                     function=FunctionCall(name=call.function.name,
                                                           arguments="")))
        o = self.open
        upto = len(self.pending) - HOLD
        if upto > o.args_start + o.sent:
            piece = self.pending[o.args_start + o.sent:upto]
            o.sent += len(piece)
            o.call.function.arguments += piece
            out.append(ToolCallDelta(index=len(self.calls) - 1,
                                     function=FunctionCall(arguments=piece)))
        return out

    def _rest(self, block: str, closed: bool) -> ToolCallDelta:
        """The announced call's last arguments piece: up to the wrapper's closing brace."""
        o, self.open = self.open, None
        inner = block[:len(block) - len(CLOSE)] if closed else block
        args = inner[o.args_start:].rstrip()
        args = args[:-1].rstrip() if args.endswith("}") else args  # the wrapper's brace
        piece = args[o.sent:]
        o.call.function.arguments += piece
        return ToolCallDelta(index=len(self.calls) - 1, function=FunctionCall(arguments=piece))


def _partial_open(text: str) -> int:
    """How many characters at the end of text could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
