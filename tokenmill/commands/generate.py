"""`tokenmill generate [MODEL] PROMPT`: stream one completion, then print timing stats."""

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


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT",
                   help=f"model path or name (default: {DEFAULT_MODEL}) and the prompt")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    add_sampling_args(p)
    add_engine_args(p)
    # one stream at a time: size the KV cache for one sequence, not max_num_seqs=32 of them
    # (32 x 8192 positions of the default model is ~12 GB of zeroed memory on the CPU)
    p.set_defaults(run=run, max_num_seqs=1)


def run(args) -> int:
    if len(args.args) > 2:
        raise ValueError("expected [MODEL] PROMPT; quote the prompt")
    model, prompt = (DEFAULT_MODEL, args.args[0]) if len(args.args) == 1 else args.args
    from tokenmill.llm import LLM

    llm = LLM(model, **engine_kwargs(args))
    request = prompt
    tok = llm.tokenizer
    if not args.raw and tok is not None and tok.chat_template:
        request = llm.chat_prompt([{"role": "user", "content": prompt}])
    last = None
    for out in llm.stream(request, sampling_params(args)):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last), file=sys.stderr)
    return 0
