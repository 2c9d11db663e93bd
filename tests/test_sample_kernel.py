"""The kernels' sampler (csrc/sample.cpp) against the reference draw (layers/sampler.py:
Sampler.probs, then inverse_cdf) with the same uniform numbers, for every instruction set this
CPU runs: temperature, min-p, top-k, top-p and their mixes, masked tokens, ties, and the rows
it leaves to the reference."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.kernels import build
from tokenmill.layers import ops
from tokenmill.layers.sampler import Sampler, SamplingMetadata, inverse_cdf

pytestmark = [pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here"),
              pytest.mark.skipif(os.environ.get("TOKENMILL_KERNELS") == "0",
                                 reason="TOKENMILL_KERNELS=0: reference ops only")]
REFERENCE = Sampler(torch.device("cpu"), backend=ops.TorchOps())


def meta(rows, temperature, top_k=0, top_p=1.0, min_p=0.0) -> SamplingMetadata:
    return SamplingMetadata(temperatures=[temperature] * rows, top_k=[top_k] * rows,
                            top_p=[top_p] * rows, min_p=[min_p] * rows,
                            generators=[None] * rows, banned=[[]] * rows,
                            penalties=[None] * rows, logprobs=[None] * rows)


def both(kops, logits, m: SamplingMetadata, u):
    probs = REFERENCE.probs(logits, m)
    got = kops.sample(logits, m.temperatures, m.top_k, m.top_p, m.min_p, u)
    return got, inverse_cdf(probs, u), probs


def assert_same_draws(got, want, probs, u):
    """Equal tokens, but for a uniform within float rounding of a boundary of the reference's
    cumulative distribution (the kernel adds its weights in another order)."""
    for r in (got != want).nonzero().flatten().tolist():
        cdf = probs[r].double().cumsum(0)
        target = u[r].item() * cdf[-1].item()
        edge = cdf[min(got[r], want[r]).item()].item()  # the boundary between the two tokens
        assert abs(edge - target) < 1e-5, (r, got[r].item(), want[r].item())
    assert (got != want).sum().item() <= max(1, len(got) // 50)


@pytest.mark.parametrize("vocab", [1, 7, 21, 257, 49152])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0),
    (1.3, 50, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 20, 0.95, 0.02), (5.0, 0, 0.5, 0.0),
    (0.3, 3, 0.6, 0.0)])
def test_draws_equal_the_reference(kops, vocab, temperature, top_k, top_p, min_p):
    torch.manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab) * 3
    if vocab > 2:
        logits[:, 1::5] = -float("inf")  # masked tokens (a grammar's, a ban's)
    m = meta(rows, temperature, top_k, top_p, min_p)
    u = torch.rand(rows)
    u[:3] = torch.tensor([0.0, 1 - 2 ** -24, 0.5])
    got, want, probs = both(kops, logits, m, u)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert (probs.gather(1, got[:, None]) > 0).all()  # never a filtered token
    assert_same_draws(got, want, probs, u)


def test_a_peaked_row_and_ties_at_the_kth_logit(kops):
    logits = torch.full((4, 300), -4.0)
    logits[:, 10], logits[:, 20:25] = 8.0, 2.0  # top-k=3 keeps 10 and all five tied at 2.0
    m = meta(4, 1.0, top_k=3)
    u = torch.tensor([0.0, 0.9990, 0.99999, 0.5])
    got, want, probs = both(kops, logits, m, u)
    assert torch.equal(got, want)
    assert set(got.tolist()) <= {10, *range(20, 25)}
    assert (probs[0] > 0).sum().item() == 6


def test_draw_frequencies_follow_the_probabilities(kops):
    """Uniforms spread evenly over [0, 1): each token drawn in proportion to its probability
    (to within one draw), with top-p keeping the two best (0.55 + 0.20 reach 0.7)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    n = 2000
    u = (torch.arange(n) + 0.5) / n
    nucleus = torch.zeros(5)
    nucleus[[4, 0]] = torch.tensor([2.0, 1.0]).softmax(-1)
    for m, probs in [(meta(n, 1.0), logits.softmax(-1)), (meta(n, 1.0, top_p=0.7), nucleus)]:
        got = kops.sample(logits.repeat(n, 1), m.temperatures, m.top_k, m.top_p, m.min_p, u)
        counts = torch.bincount(got, minlength=5).double()
        assert (counts - n * probs.double()).abs().max().item() <= 1.0


def test_rows_left_to_the_reference(kops):
    logits = torch.randn(5, 100)
    logits[1, 7] = float("nan")
    logits[2] = -float("inf")
    logits[3, :99] = -float("inf")  # one token left: always drawn
    temps = [0.0, 1.0, 1.0, 1.0, 0.9]
    m = SamplingMetadata(temperatures=temps, top_k=[0] * 5, top_p=[0.9] * 5, min_p=[0.0] * 5,
                         generators=[None] * 5, banned=[[]] * 5, penalties=[None] * 5,
                         logprobs=[None] * 5)
    got = kops.sample(logits, m.temperatures, m.top_k, m.top_p, m.min_p, torch.rand(5))
    assert got[:3].tolist() == [-1, -1, -1] and got[3].item() == 99 and 0 <= got[4].item() < 100


def test_the_sampler_uses_it_and_keeps_its_random_stream(kops):
    """Sampler.__call__ through the kernels and through the reference, same seed: the same
    tokens (the same uniforms drawn in the same order), greedy rows by argmax; a NaN row
    falls back to the reference for the whole call."""
    torch.manual_seed(3)
    logits = torch.randn(6, 1000) * 2
    m = meta(6, 0.8, top_p=0.95)
    m.temperatures[2] = 0.0
    for bad in (False, True):
        if bad:
            logits[4, 5] = float("nan")
        fast = Sampler(torch.device("cpu"), seed=11, backend=kops)(logits, m).token_ids
        ref = Sampler(torch.device("cpu"), seed=11, backend=ops.TorchOps())(logits, m).token_ids
        assert fast == ref
        assert fast[2] == logits[2].argmax().item()



def test_tensors_off_the_cpu_are_an_error_not_a_crash(kops):
    logits, ones = torch.randn(2, 50), torch.ones(2)
    ok = (ones, torch.zeros(2, dtype=torch.int64), ones, torch.zeros(2), torch.rand(2))
    assert kops.lib.sample_rows(logits, *ok).shape == (2,)
    with pytest.raises(ValueError, match="on the CPU"):
        kops.lib.sample_rows(logits, ok[0].to("meta"), *ok[1:])
