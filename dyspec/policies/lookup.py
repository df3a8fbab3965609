"""Prompt lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in transformers): copies, and
the draft model only where nothing matches. Where the context's last n tokens (n = ngram down to
min_ngram) occurred before, the tokens that followed their latest earlier occurrence are proposed
as a chain. A small target's answers repeat their prompt and themselves, so matches of 2 or 3
tokens are common and a chain of copied tokens is accepted well, at no draft cost; 1-grams match
often but are accepted poorly, so min_ngram defaults to 2.

A copied token is a proposal chosen, not sampled: its q is one-hot, and at T > 0 it is verified as
such (`verify_sampled`, "deterministic"), so outputs keep the target's distribution. Where nothing
matches, the step drafts `fallback` tokens as a chain from the draft model, when one is loaded, or
none: `fallback=0` is plain prompt lookup. With `confidence` the fallback chain stops once its value
falls below it (`chain.build`): `fallback=4, confidence=0.5` drafts a second token only after a
confident first, which beats one token a step on a CPU (docs/results). Under `--budget auto` the
budget bounds the fallback alone: copies cost no draft time, so the engine asks for up to
`free_budget` of them and cuts them to what pays at the acceptance rate it learns for copies after
matches of their length (`budget.copy_bin`: 0.40 for the first token after a 2-token match, 0.95
after 6 or more).
"""

import torch

from dyspec.core.contract import AutoNeeds, Policy
from dyspec.core.copying import copied
from dyspec.core.draft import DraftSession
from dyspec.core.tree import Tree
from dyspec.errors import DyspecError
from dyspec.policies.chain import build as chain_build
from dyspec.policies.chain import check_confidence


def build(
    draft: DraftSession,
    root: int,
    budget: int,
    temperature: float,
    generator: torch.Generator,
    *,
    ngram: int = 6,
    min_ngram: int = 2,
    fallback: int = 1,
    confidence: float = 0.0,
    free_budget: int | None = None,
) -> Tree:
    if not 1 <= min_ngram <= ngram:
        raise DyspecError(f"lookup needs 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
    if fallback < 0:
        raise DyspecError(f"fallback must be >= 0 draft tokens, got {fallback}")
    check_confidence(confidence)  # here, not only when a step falls back
    tokens, match = copied(draft.context, ngram, min_ngram, budget if free_budget is None else free_budget)
    if not tokens and fallback and budget and draft.kv is not None:
        return chain_build(draft, root, min(fallback, budget), temperature, generator, confidence=confidence)
    tree = Tree.root(root, sampling="deterministic")
    for token in tokens:
        tree.add(tree.size, token, 1.0)
    if tokens:
        tree.end_expansion()
    tree.copied_after = match
    return tree


POLICY = Policy(
    "lookup",
    build,
    needs_draft=False,
    draft_option="fallback",
    auto=AutoNeeds(free_nodes=True),
    summary="prompt lookup: copies what followed the last words where they occurred before; "
    "where nothing matches, the draft's next token (`fallback` tokens)",
)
