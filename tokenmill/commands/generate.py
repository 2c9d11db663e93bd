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
                   help="send the prompt as is, without the model's chat template (always so for "
                        "a model whose file has no template of its own: a base model)")
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
    last = None
    for out in llm.stream(request_for(llm, prompt, args.raw), sampling_params(args)):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last), file=sys.stderr)
    return 0


def request_for(llm, prompt: str, raw: bool):
    """The prompt in the model's own chat template as a user turn; as it is with --raw, or
    where the file ships no template (a base model, such as gemma-3-270m: the family's
    template, which the chat endpoints still use, would turn a completion into a chat turn
    the model was never trained on; llama.cpp's llama-cli completes there too)."""
    tok = llm.tokenizer
    if raw or tok is None or not tok.chat_template or tok.family_template:
        return prompt
    return llm.chat_prompt([{"role": "user", "content": prompt}])
