"""What n-gram speculation can gain at 16 concurrent requests on this machine, and how much
of it tokenmill's planner takes: the grounded workload's greedy outputs replayed against step
costs measured here. A model, not a timing of speculation (spec_decode.py times that):

1. the workload (32 requests through 16 batch slots, as spec_decode.py) on two engines stepped
   side by side, without speculation and with n-gram k8 n 1-8; every decode-only step of both
   fit by least squares: step = a + b x sequences + c x positions attended + d x draft rows
   + e where the step had speculation (proposing, planning, verifying: Python per step);
2. at every output position of every request, the n-gram proposal (the engine's index, n 1-8,
   k 8) and how many of its tokens the greedy output goes on with;
3. continuous batching replayed with each policy: none; an oracle that drafts exactly the
   tokens that will be accepted (the ceiling); drafting only after 8-token matches; the
   engine's DraftPlanner, learning acceptance as it goes, fed the model's costs; the same
   without the per-step cost e. Decode steps only (the prompts' prefill is the same for
   every policy), at the fitted draft-row cost d and at others: what a cheaper draft row
   would change.

    python benchmarks/spec_replay.py [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine  # noqa: E402
from benchmarks.spec_decode import CONFIGS, conversations, side_by_side  # noqa: E402

SCALES = (0.5, 0.75, 1.0, 1.25)  # draft-row costs replayed, x the fitted one
SPEC = "ngram k8 n1-8"


def record(engines: dict, max_tokens: int) -> tuple[list[dict], dict]:
    """The grounded workload at 16 concurrent on each engine, stepped side by side (as
    spec_decode.py does): the first engine's greedy outputs, and per engine every decode-only
    step's (sequences, positions attended, drafts, seconds)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    convs = conversations("grounded", variants=4)
    steps, outputs, last = {}, [], {}
    for name, llm in engines.items():
        llm.chat(convs[:2], params, use_tqdm=False)  # warm-up
        steps[name] = []
        schedule = llm.engine.scheduler.schedule

        def captured(schedule=schedule, name=name):
            sched = schedule()  # what it holds before the step runs (drafts are cleared after)
            last[name] = [(s.num_tokens, len(s.spec_token_ids), s.runs_as_decode(n))
                          for s, n in sched.scheduled]
            return sched

        llm.engine.scheduler.schedule = captured
    first = next(iter(engines))
    for name, finished, seconds in side_by_side(engines, convs, params):
        rows, last[name] = last.get(name, []), []
        if rows and all(decode for *_, decode in rows):
            steps[name].append((len(rows), sum(n for n, *_ in rows),
                                sum(d for _, d, _ in rows), seconds))
        if name == first:
            outputs += [dict(prompt=list(o.prompt_token_ids), out=list(o.outputs[0].token_ids))
                        for o in finished]
    return outputs, steps


def proposals(outputs: list[dict]) -> list[dict]:
    """Per request and output position t >= 1: (matched length, drafts, how many are right)."""
    from tokenmill.spec_decode.ngram import NgramIndex

    for r in outputs:
        index, out, r["at"] = NgramIndex(1, 8), r["out"], []
        for t in range(1, len(out)):
            drafted, matched = index.propose(r["prompt"] + out[:t], 8)
            right, rest = 0, out[t:]
            while right < min(len(drafted), len(rest)) and drafted[right] == rest[right]:
                right += 1
            r["at"].append((matched, len(drafted), right))
    return outputs


class ModelCost:
    """The replay's step cost, and the same in the planner's terms: (rows, sequences) ->
    seconds (at the workload's mean length)."""

    def __init__(self, fit, draft: float, positions: float) -> None:
        self.a, self.b, self.c, _, self.spec = fit
        self.draft, self.positions = draft, positions

    def step(self, seqs: int, positions: int, drafts: int, spec: bool = True) -> float:
        return (self.a + self.spec * spec + self.b * seqs + self.c * positions
                + self.draft * drafts)

    def __call__(self, rows: int, seqs: int | None = None) -> float:
        seqs = rows if seqs is None else seqs
        return self.step(seqs, seqs * self.positions, rows - seqs)


def replay(outputs: list[dict], cost: ModelCost, policy, slots: int = 16) -> dict:
    queue, running, seconds, drafted, accepted = list(range(len(outputs))), {}, 0.0, 0, 0
    while queue or running:
        while queue and len(running) < slots:
            running[queue.pop(0)] = 1  # the first token came from the prompt's pass
        live = {i: t for i, t in running.items() if t < len(outputs[i]["out"])}
        plan = policy(outputs, live, len(live))
        positions = drafts = 0
        for i, t in live.items():
            r = outputs[i]
            matched, n, right = r["at"][t - 1]
            d = min(plan.get(i, 0), n, len(r["out"]) - t - 1)
            drafts, positions = drafts + d, positions + len(r["prompt"]) + t
            drafted, accepted = drafted + d, accepted + min(d, right)
            running[i] = t + min(d, right) + 1
        for i in [i for i, t in running.items() if t >= len(outputs[i]["out"])]:
            del running[i]
        if live:
            seconds += cost.step(len(live), positions, drafts, spec=policy is not none)
    return dict(seconds=seconds, drafted=drafted, accepted=accepted)


def none(outputs, live, seqs):
    return {}


def oracle(outputs, live, seqs):
    return {i: outputs[i]["at"][t - 1][2] for i, t in live.items()}


def after_8_matches(outputs, live, seqs):
    return {i: 8 for i, t in live.items() if outputs[i]["at"][t - 1][0] >= 8}


def planner(cost: ModelCost):
    from tokenmill.spec_decode.adaptive import DraftPlanner

    plan = DraftPlanner(8, cost)

    def policy(outputs, live, seqs):
        props = {}
        for i, t in live.items():
            matched, n, _ = outputs[i]["at"][t - 1]
            if min(n, len(outputs[i]["out"]) - t - 1) > 0:
                props[i] = (min(n, len(outputs[i]["out"]) - t - 1), matched)
        keep = plan.plan(props, seqs) if plan.worthwhile(seqs) else {}
        for i, d in keep.items():
            if d:
                matched, _, right = outputs[i]["at"][live[i] - 1]
                plan.record(matched, d, min(d, right))
        return keep

    return policy


def main() -> None:
    from tokenmill import LLM
    from tokenmill.loaders.resolve import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    path = resolve_model(args.model)
    engines = {name: LLM(path, max_num_seqs=16, max_model_len=2048,
                         speculative_config=CONFIGS[name]) for name in ("none", SPEC)}
    outputs, steps = record(engines, args.max_tokens)
    rows = [[1.0, s, p, d, float(name != "none")] for name in steps for s, p, d, _ in steps[name]]
    x, y = np.array(rows), np.array([t for name in steps for *_, t in steps[name]])
    fit = np.linalg.lstsq(x, y, rcond=None)[0]  # a, per sequence, per position, per draft, spec
    positions = float(x[:, 2].sum() / x[:, 1].sum())
    proposals(outputs)
    print(f"{len(y)} decode steps of both engines: step = {1e3 * fit[0]:.2f} ms + "
          f"{1e3 * fit[1]:.3f} ms a sequence + {1e6 * fit[2]:.2f} us a position attended (mean "
          f"{positions:.0f}) + {1e3 * fit[3]:.3f} ms a draft row + {1e3 * fit[4]:.2f} ms a "
          f"step with speculation ({SPEC}: proposing, planning, verifying)")
    drafts = [s * fit[3] for s in SCALES]
    print(f"{'decode steps, replayed':28s}" + "".join(f"{f'draft {1e3 * d:.2f} ms':>17s}"
                                                      for d in drafts))
    table = {}
    for name in ("oracle", "after 8-token matches", "planner",
                 "planner, no spec step cost"):
        table[name] = {}
        for d in drafts:
            cost = ModelCost(fit, d, positions)
            if name.endswith("no spec step cost"):
                cost.spec = 0.0
            base = replay(outputs, cost, none)["seconds"]
            policy = {"oracle": oracle, "after 8-token matches": after_8_matches}.get(
                name) or planner(cost)
            r = replay(outputs, cost, policy)
            table[name][f"{1e3 * d:.3f}"] = dict(ratio=base / r["seconds"], **r)
        print(f"{name:28s}" + "".join(f"{v['ratio']:16.3f}x" for v in table[name].values()))
    print(json.dumps({"benchmark": "spec_replay", "machine": machine(), "spec": SPEC,
                      "step_fit_ms": dict(zip(("step", "sequence", "position", "draft",
                                               "spec_step"), (1e3 * v for v in fit))),
                      "mean_positions": positions, "replay": table}))


if __name__ == "__main__":
    main()
