"""Verification: decide which draft tokens the target keeps, and the one token it adds.

Pure functions of (draft ids, draft probs, target logits, sampling params, generator). The caller passes the
target rows already transformed by the request's history (sampling.adjust_logits: penalties, bias, min_tokens,
row i from the history through guess i) and masked by its grammar, and the draft's q transformed the same way.
Greedy verification keeps the longest prefix of the draft that matches the target's argmax; speculative (rejection) sampling
follows Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023 (arXiv 2302.01318), which
makes the emitted tokens distributed exactly as plain sampling from the target's processed distribution.

Token trees (a draft with `parents`, spec_decode/tree.py): `tree_greedy_verify` walks down from the root along
the target's argmax while some child carries it, so it keeps the longest root path the target agrees with and
emits exactly plain greedy decoding's tokens. Trees are verified greedily only: a sampled request gets a chain
(its proposer's most likely branch) and the rejection sampling above — chain-only sampling, never a lossy
multi-branch shortcut.

Randomness is position-addressed when the caller passes the output `position` of the first verified row and a
sampling.PositionalGenerator: the numbers for output position i are the generator's `uniforms(i, purpose)`, the
same whatever happened before (a request resumed after an engine restart draws what the undisturbed run drew).
A point-mass draft (n-gram, suffix: probs None) is verified by drawing the target's own token at each position,
x*_i = inverse-CDF(p_i, u_i), accepting guess i iff it equals x*_i and emitting x*_i at the first mismatch (or as
the bonus): guess x is accepted with probability p(x), and on a mismatch x* is distributed as p without x,
renormalised — exactly the point-mass rejection rule — while every emitted token is the one plain sampling draws
at its position, so a seeded request's output does not depend on k or on where its steps began. A draft model's
q keeps min(1, p/q) with the uniforms of its positions (its output depends on where drafts begin: a resumed
request matches the run it resumes only where step boundaries agree). With a plain torch.Generator (or None), or
no position, the same rules draw in sequence from the generator.

This module does not know models, KV caches, proposers or the scheduler: the caller runs the target on
`[last_token, *draft_ids]`, passes the k+1 logit rows here, and rolls back whatever was not accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.sampling import (PURPOSE_ACCEPT, PURPOSE_RESIDUAL, PURPOSE_TARGET, PositionalGenerator, SamplingParams,
                                greedy_ids, inverse_cdf, process_logits)


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of verifying one draft of k tokens.

    `token_ids` is the accepted draft prefix followed by exactly one more token: the target's correction at
    the first rejected position, or the bonus token from the last target row when all k were accepted.
    So `len(token_ids) == num_accepted + 1` always, and a draft of k = 0 is plain decoding.
    """

    num_accepted: int
    token_ids: list[int]
    path: tuple[int, ...] | None = None  # a tree draft: the chunk rows of the accepted guesses; None: a chain


def greedy_verify(
    draft_ids: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k + 1, vocab_size]
) -> VerifyResult:
    """Accept while the draft equals the target's argmax; then emit the target's argmax.

    Row i of `target_logits` is the target's prediction for draft position i; row k predicts the bonus.
    Ties break like `process_logits(temperature=0)` (both `greedy_ids`: torch.argmax's first maximum), so this
    equals plain greedy decoding.
    """
    _check_shapes(draft_ids, None, target_logits)
    k = draft_ids.shape[0]
    target_ids = greedy_ids(target_logits)  # [k + 1]
    matches = (draft_ids.to(target_ids.device) == target_ids[:k]).tolist()
    num_accepted = next((i for i, ok in enumerate(matches) if not ok), k)
    # the accepted prefix equals the target's own argmax prefix, so one slice gives prefix + correction/bonus
    return VerifyResult(num_accepted, target_ids[: num_accepted + 1].tolist())


def tree_greedy_verify(
    draft_ids: torch.Tensor,  # [k] int64: guess i in chunk row i + 1
    parents: tuple[int, ...],  # [k] chunk row of each guess's parent (0: the pending token); parents precede children
    target_logits: torch.Tensor,  # [k + 1, vocab_size]: row r predicts what follows row r's token
) -> VerifyResult:
    """From the root, step to the child whose token is the target's argmax at the current row while there is one
    (siblings carry distinct tokens; were two equal, the first is taken); then emit the argmax of the row reached.
    Every emitted token is the target's argmax given the tokens before it, so this equals plain greedy decoding."""
    _check_shapes(draft_ids, None, target_logits)
    if len(parents) != draft_ids.shape[0]:
        raise ValueError(f"{len(parents)} parents for {draft_ids.shape[0]} guesses")
    target_ids = greedy_ids(target_logits).tolist()  # [k + 1]
    children: dict[tuple[int, int], int] = {}
    for i, (p, tok) in enumerate(zip(parents, draft_ids.tolist())):
        if not 0 <= p <= i:
            raise ValueError(f"guess {i}'s parent row {p} does not precede it")
        children.setdefault((p, tok), i + 1)
    row, path, tokens = 0, [], []
    while (row, target_ids[row]) in children:
        tokens.append(target_ids[row])  # the child's token: the target's own choice
        row = children[(row, target_ids[row])]
        path.append(row)
    return VerifyResult(len(path), tokens + [target_ids[row]], tuple(path))


def rejection_verify(
    draft_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, vocab_size] processed draft probs; None = point mass (n-gram)
    target_logits: torch.Tensor,  # [k + 1, vocab_size]
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    min_p: float = 0.0,
    position: int | None = None,  # output position of the first verified row (position-addressed randomness)
) -> VerifyResult:
    """Speculative sampling: accept x_i with prob min(1, p(x_i)/q(x_i)), correct from norm(max(0, p - q)).

    p is the target's distribution after `process_logits` with the request's parameters; `draft_probs` must
    already be processed with the same parameters by the proposer. With `draft_probs=None` the draft is a
    point mass on its token (q(x) = 1): the target's own draw x*_i at each position decides (accepted iff it
    equals the guess, so with prob p(x); the mismatching x* is the correction, p without x renormalised).
    Randomness: `_Draws` (position-addressed with a PositionalGenerator and a `position`, else in sequence).
    """
    _check_shapes(draft_ids, draft_probs, target_logits)
    k = draft_ids.shape[0]
    target_probs = process_logits(target_logits, temperature, top_k, top_p, min_p)  # [k + 1, vocab_size]
    draft_ids = draft_ids.to(target_probs.device)
    draft_list = draft_ids.tolist()
    draws = _Draws(generator, position)

    if draft_probs is None:  # point mass: the target's draw at each row, until one differs from the guess
        for i in range(k + 1):
            x = int(inverse_cdf(target_probs[i : i + 1], draws(i, PURPOSE_TARGET))[0])
            if i == k or x != draft_list[i]:
                return VerifyResult(i, draft_list[:i] + [x])

    num_accepted = k
    if k > 0:
        positions = torch.arange(k, device=target_probs.device)
        p_draft = target_probs[positions, draft_ids].double()  # [k]
        u = draws(0, PURPOSE_ACCEPT, k).to(target_probs.device)  # [k]
        # u < p/q without the division: a token the draft gave q(x) = 0 is accepted iff p(x) > 0
        accepted = u * draft_probs.to(target_probs.device)[positions, draft_ids].double() < p_draft
        # one host sync for the whole draft; the first False is the rejected position
        num_accepted = next((i for i, ok in enumerate(accepted.tolist()) if not ok), k)

    n = num_accepted
    if n == k:  # bonus: every draft token passed; the target's own draw at its position
        next_id = int(inverse_cdf(target_probs[k:], draws(k, PURPOSE_TARGET))[0])
    else:
        residual = _residual(target_probs[n : n + 1], draft_list[n], draft_probs, n)  # [1, vocab_size]
        next_id = int(inverse_cdf(residual, draws(n, PURPOSE_RESIDUAL))[0])
    return VerifyResult(n, draft_list[:n] + [next_id])


class _Draws:
    """Where verification's uniforms come from: `(row, purpose, n)` -> [n] float64. Position-addressed (row r is
    output position `position + r`; n numbers of one purpose at consecutive positions) with a
    PositionalGenerator and a position; otherwise the generator's next n numbers."""

    def __init__(self, generator: torch.Generator | None, position: int | None):
        self.generator = generator
        self.positional = isinstance(generator, PositionalGenerator) and position is not None
        self.position = position

    def __call__(self, row: int, purpose: int, n: int = 1) -> torch.Tensor:  # -> [n] float64
        if self.positional:
            if n == 1:
                return self.generator.uniforms(self.position + row, purpose)
            return torch.cat([self.generator.uniforms(self.position + row + i, purpose) for i in range(n)])
        return torch.rand(n, generator=self.generator, dtype=torch.float64,
                          device=self.generator.device if self.generator is not None else "cpu")


def _residual(
    target_row: torch.Tensor,  # [1, vocab_size] p at the rejected position
    draft_id: int,  # the rejected draft token
    draft_probs: torch.Tensor | None,  # [k, vocab_size] or None
    position: int,
) -> torch.Tensor:  # [1, vocab_size] unnormalised; inverse_cdf normalises
    """max(0, p - q) at the rejected position, falling back to p when it has no mass.

    In exact arithmetic a rejection implies the residual has mass (p(x) < q(x) somewhere forces p > q
    elsewhere); the fallback only guards float rounding when p == q up to noise.
    """
    if draft_probs is None:
        residual = target_row.clone()
        residual[0, draft_id] = 0.0  # max(0, p - onehot(x)) is p with x removed
    else:
        q_row = draft_probs[position : position + 1].to(target_row.device)  # [1, vocab_size]
        residual = (target_row - q_row).clamp_(min=0.0)
    if residual.sum().item() <= 0:
        return target_row
    return residual


def verify(
    draft_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, vocab_size] or None
    target_logits: torch.Tensor,  # [k + 1, vocab_size]
    params: SamplingParams,
    generator: torch.Generator | None,
    parents: tuple[int, ...] | None = None,  # [k] a token tree's parent rows; None: a chain
    position: int | None = None,  # output position of row 0 (the tokens already emitted): position-addressed draws
) -> VerifyResult:
    """Greedy verification at temperature 0, speculative sampling otherwise; a tree greedily only."""
    if parents is not None:
        if not params.greedy:
            raise ValueError("token trees are verified greedily only: a sampled request's draft must be a chain")
        return tree_greedy_verify(draft_ids, parents, target_logits)
    if params.greedy:
        return greedy_verify(draft_ids, target_logits)
    return rejection_verify(
        draft_ids, draft_probs, target_logits, params.temperature, params.top_k, params.top_p, generator,
        params.min_p, position)


def _check_shapes(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor
) -> None:
    if draft_ids.dim() != 1 or target_logits.dim() != 2 or target_logits.shape[0] != draft_ids.shape[0] + 1:
        raise ValueError(
            f"expected draft_ids [k] and target_logits [k+1, V], got {tuple(draft_ids.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    k = draft_ids.shape[0]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {target_logits.shape[1]}], got {tuple(draft_probs.shape)}")
