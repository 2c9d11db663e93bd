"""`tokenmill tokenize [MODEL] [TEXT]`: a text's tokens, one a line; with --compare, a model's
tokens per character on the same sentences in several languages. Loads only the tokenizer."""

from __future__ import annotations

import json
import os
import sys

from tokenmill.commands.common import DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("tokenize", help="show a text's tokens, or compare tokens per language")
    p.add_argument("args", nargs="*", metavar="[MODEL] [TEXT]",
                   help=f"model path or name (default: {DEFAULT_MODEL}) and the text; '-' or "
                        "no text reads it from stdin. One argument is the model if it names "
                        "one (a known name or an existing path), else the text")
    p.add_argument("--compare", action="store_true",
                   help="tokens per character of the same sentences in several languages, "
                        "and of a code snippet")
    p.add_argument("--tokenizer", help="tokenizer path when it is not next to the model")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="leave out the tokens the tokenizer adds to every text (BOS)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    model, text = _split_args(args.args, args.compare)
    tok = open_tokenizer(model, args.tokenizer)
    if args.compare:
        rows = compare(tok)
        if args.json:
            print(json.dumps({"model": model, "vocab_size": tok.vocab_size, "rows": rows},
                             ensure_ascii=False))
        else:
            print(f"{model}: {tok.vocab_size} tokens in the vocabulary")
            print(format_compare(rows))
        return 0
    ids = tok.encode(text, add_special_tokens=not args.no_special_tokens)
    from tokenmill.token_bytes import token_values

    values = token_values(tok, ids)
    if args.json:
        tokens = [{"id": i, "bytes": list(v)} if isinstance(v, bytes) else {"id": i, "text": v}
                  for i, v in zip(ids, values)]
        print(json.dumps({"count": len(ids), "characters": len(text), "tokens": tokens},
                         ensure_ascii=False))
    else:
        print(format_tokens(ids, values))
        per_char = f" ({len(ids) / len(text):.2f} tokens per character)" if text else ""
        print(f"{len(ids)} token{'s' * (len(ids) != 1)}, {len(text)} characters{per_char}")
    return 0


def _split_args(args: list[str], compare: bool) -> tuple[str, str | None]:
    """(model, text) from [MODEL] [TEXT]; the text is read from stdin when absent or '-'."""
    if len(args) > (1 if compare else 2):
        raise ValueError("expected [MODEL] --compare" if compare else
                         "expected [MODEL] [TEXT]; quote the text")
    if len(args) == 2:
        model, text = args
    elif len(args) == 1 and (compare or _names_model(args[0])):
        model, text = args[0], None
    else:
        model, text = DEFAULT_MODEL, args[0] if args else None
    if compare:
        return model, None
    return model, _read_stdin() if text in (None, "-") else text


def _names_model(arg: str) -> bool:
    from tokenmill import hub

    return arg in hub.KNOWN_MODELS or os.path.exists(arg)


def _read_stdin() -> str:
    if sys.stdin.isatty():
        print("reading the text from stdin; end it with Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def open_tokenizer(model: str, tokenizer: str | None = None):
    """The model's tokenizer without its weights: from a model (folder, GGUF, llama2.c file or
    known name) or a tokenizer file alone (tokenizer.json, a llama2.c tok*.bin)."""
    from tokenmill.loaders.resolve import load_tokenizer, resolve_model

    tok = load_tokenizer(tokenizer or resolve_model(model))
    if tok is None:
        raise ValueError(f"{model!r} has no tokenizer; give one with --tokenizer")
    return tok


def format_tokens(ids: list[int], values: list[str | bytes]) -> str:
    """A table: position, id, and the token's text (or bytes: part of a character) as repr."""
    width = max([len("id"), *(len(str(i)) for i in ids)])
    lines = [f"{'#':>5}  {'id':>{width}}  token"]
    lines += [f"{n:>5}  {i:>{width}}  {v!r}" for n, (i, v) in enumerate(zip(ids, values))]
    return "\n".join(lines)


def compare(tok) -> list[dict]:
    """Characters and tokens of each built-in sample text; translations also relative to the
    reference language's token count."""
    from tokenmill.parallel_texts import REFERENCE, SAMPLES, TRANSLATIONS

    counts = {name: len(tok.encode(text, add_special_tokens=False))
              for name, text in SAMPLES.items()}
    return [{"text": name, "characters": len(text), "tokens": counts[name],
             "tokens_per_character": counts[name] / len(text),
             "relative_to_english": (counts[name] / counts[REFERENCE]
                                     if name in TRANSLATIONS else None)}
            for name, text in SAMPLES.items()]


def format_compare(rows: list[dict]) -> str:
    width = max(len(r["text"]) for r in rows)
    lines = [f"{'text':<{width}}  {'chars':>5}  {'tokens':>6}  {'tokens/char':>11}  vs English"]
    for r in rows:
        rel = r["relative_to_english"]
        lines.append(f"{r['text']:<{width}}  {r['characters']:>5}  {r['tokens']:>6}  "
                     f"{r['tokens_per_character']:>11.2f}  "
                     f"{'-' if rel is None else f'{rel:.2f}x':>10}")
    return "\n".join(lines)
