"""`tokenmill chat [MODEL]`: an interactive conversation using the model's chat template."""

from __future__ import annotations

import sys

from tokenmill.commands.common import (
    DEFAULT_MODEL,
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    format_stats,
    sampling_params,
)

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) quits."


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"model path or name (default: {DEFAULT_MODEL})")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--stats", action="store_true", help="print timing stats after each reply")
    add_sampling_args(p, temperature=0.7)
    add_engine_args(p)
    # one stream at a time: size the KV cache for one sequence, not max_num_seqs=32 of them
    # (32 x 8192 positions of the default model is ~12 GB of zeroed memory on the CPU)
    p.set_defaults(run=run, max_num_seqs=1)


def run(args) -> int:
    from tokenmill.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise ValueError(f"model {args.model!r} has no chat template; use `tokenmill generate`")
    params = sampling_params(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP, file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(start)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        reply, last = "", None
        for out in llm.stream(llm.chat_prompt(messages), params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            reply, last = out.outputs[0].text, out
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
        if args.stats and last is not None:
            print(format_stats(last), file=sys.stderr)
