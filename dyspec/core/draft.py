"""The draft side of one generation: what policies call to get draft distributions.

Committed tokens reach the draft lazily: they wait in `pending` until a policy asks for the root's
distribution, so a policy that never drafts (`ar`) never runs the draft; where a policy drafts, the
draft reads the prompt at prefill (`read_prompt`). Within a step, tree nodes are forwarded in
batches with tree attention; after verification the accepted nodes the draft has already seen keep
their KV, and the rest of the accepted path joins `pending`.

A feature-conditioned draft (dyspec.drafts.feature) also reads, with each token, the target's hidden
state at the token before it: `pending_features` holds those for the pending tokens. Inside a tree
it reads its own predicted feature at the parent instead; after verification it forgets its tree
nodes and reads the accepted path again with the target's real features (as EAGLE does).

A draft with `copy_weights` (a feature draft fitted by `dyspec distill`) copies: each node's
distribution gets the token that followed the latest repeat of its context (dyspec.core.copying).

A draft with a reduced vocabulary (`vocab`, dyspec.core.vocab) returns logits over it alone, except
for a call in which a copy is a token outside it: that call's logits span the target's vocabulary.
"""

from __future__ import annotations

import bisect
import time
from array import array

import numpy as np
import torch
from transformers import PreTrainedModel

from dyspec.core.copying import copy_token, copy_tokens, mix, mix_rows
from dyspec.core.draft_model import PLAIN, draft_model
from dyspec.core.kv import KVSession, sync, tree_mask
from dyspec.core.programs import program
from dyspec.core.tree import Tree
from dyspec.core.tree_tensors import TreeTensors, index_on
from dyspec.core.vocab import DraftVocab, widen


@program
def mix_copies(
    logits: torch.Tensor, copies: torch.Tensor, temperature: float, vocab_ids: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """`mix_rows` with each row's copied token and weight in `copies` [n, 2] float64 (a token -1 and
    weight 0 where none), the logits widened to the target's vocabulary first where the draft's is
    reduced (`vocab_ids`: its columns' token ids)."""
    if vocab_ids is not None:
        logits = widen(logits, vocab_ids, vocab_size, float("-inf"))
    return mix_rows(logits, copies[:, 0].long(), copies[:, 1], temperature)


@program
def mix_tree_copies(
    logits: torch.Tensor,
    context: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    temperature: float,
    vocab_ids: torch.Tensor | None,
    vocab_size: int,
) -> torch.Tensor:
    """The draft's `logits` after tree nodes `rows` mixed with their copies (`copy_tokens` over the
    committed `context` and each node's path, `mix_rows`), with no host read: widened to the
    target's vocabulary (`vocab_ids`: the draft's columns' token ids) where the draft's is reduced,
    since whether a copy falls outside it is not known without a read. `weights`: 0, then the
    copy weight per match length."""
    n, size = len(rows), len(tokens)
    on_path = ancestors[rows] & (torch.arange(size, device=tokens.device) > 0)
    at = torch.where(on_path, depths - 1, size - 1)  # column of each ancestor by depth; the rest to a spare one
    paths = torch.full((n, size), -1, dtype=torch.long, device=tokens.device)
    paths.scatter_(1, at, tokens.expand(n, -1))
    sequences = torch.cat([context.expand(n, -1), paths[:, : size - 1]], 1)
    copies, w = copy_tokens(sequences, len(context) + depths[rows], weights)
    if vocab_ids is not None:
        logits = widen(logits, vocab_ids, vocab_size, float("-inf"))
    return mix_rows(logits, copies, w, temperature)


@program
def tree_inputs(
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    rows: torch.Tensor,
    earlier: torch.Tensor | None,
    columns: torch.Tensor,
    mask_at: tuple,
    features: tuple | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A draft forward's inputs for tree nodes `rows`: their tokens and positions after the
    committed tokens as one [2, n] tensor (`KVSession.forward`'s `ids`), its mask (`tree_mask` at
    `mask_at`, `KVSession.tree_mask_at`: each row sees the step's uncommitted slots of its
    ancestors, the nodes forwarded this step, `earlier` (None: none) and then the rows, returned,
    sitting in slots `columns`) and, for a feature draft, the predicted features at their parents
    [1, n, F], with the table of every forwarded node's feature they are read from. `features`:
    None, or that table (None on the step's first call), the root's feature, and the last call's
    rows and hidden states (None on the first call), placed now."""
    length, start = mask_at[:2]
    forwarded = rows if earlier is None else torch.cat([earlier, rows])
    visible = torch.zeros(len(rows), start - length + len(rows), dtype=torch.bool, device=tokens.device)
    visible[:, columns] = ancestors[rows][:, forwarded]
    ids = torch.stack([tokens[rows], length - 1 + depths[rows]])
    mask = tree_mask(visible, *mask_at)
    if features is None:
        return ids, mask, forwarded, None, None
    table, root, last_rows, last_hidden = features
    if table is None:
        table = torch.cat([root[None], root.new_zeros(len(tokens) - 1, root.shape[-1])])
    if last_rows is not None:
        table = table.index_put((last_rows,), last_hidden)
    return ids, mask, forwarded, table[parents[rows]][None], table


class DraftSession:
    def __init__(
        self,
        model: PreTrainedModel | None,
        prompt: list[int],
        temperature: float = 0.0,
        kv: KVSession | None = None,
        memo: dict | None = None,
    ):
        """`kv`: the session that runs `model` (the engine's, on its fast path), else a plain one.
        `memo`: what policies keep (`Policy.learn`); the engine hands every generation of a pair the
        pair's own (`ModelPair.memo`), so it lasts across them."""
        if kv is None and model is not None:
            kv = KVSession(model, keep_hidden=True, draft_vocab=True)
        self.kv = kv
        declared = draft_model(model) if model is not None else PLAIN
        # the columns of its logits, where it reads out fewer tokens than the target has
        self.vocab = DraftVocab.of(declared.vocab, model.config.vocab_size) if kv and kv.draft_vocab else None
        self.needs_features = declared.needs_features
        self.feature_layers = declared.feature_layers  # the target layers it reads
        self.copy_weights = declared.copy_weights
        self.reads_first_token = declared.reads_first_token
        self.cacheless = declared.cacheless
        self.temperature = temperature  # the mixture with copies is taken at it (dyspec.core.copying.mix)
        self.pending = list(prompt)  # committed tokens not in the draft cache yet; the root is last
        # every committed token, the root last (what `lookup` and copying search): an int array, so that
        # a node's context (these and its path) is a memcpy, not a conversion of every token
        self.context = array("i", prompt)
        self.pending_features: torch.Tensor | None = None  # [len(pending), H], feature drafts only
        self.node_features: dict[int, torch.Tensor] = {}  # tree node -> the draft's predicted feature
        self.tree_features: torch.Tensor | None = None  # the same [nodes, H], for a tree grown on the device
        self.unplaced: tuple[torch.Tensor, torch.Tensor] | None = None  # its last call's rows and hidden states
        self.slot_of: dict[int, int] = {}  # tree node -> cache slot, for nodes forwarded this step
        self.tree_slots: list[tuple[int, torch.Tensor]] = []  # (first slot, nodes) of each `tree_logits` call
        self.forwarded_rows: torch.Tensor | None = None  # every call's nodes in slot order, from the last program
        self.context_tensor: torch.Tensor | None = None  # `context` on the device, for a step's copies there
        self.copy_table: torch.Tensor | None = None  # 0 and `copy_weights` there
        self.memo: dict = {} if memo is None else memo  # policies' learnt state, by policy
        # whether it forwards in this generation: an idle one (`ar`, `lookup` without its fallback)
        # keeps the committed tokens for the policy to search, and no features
        self.reads = True
        self.seconds = 0.0
        # this step's forwards as (tree size when issued, tree nodes forwarded): a forward issued at
        # tree size s adds nodes s and up, so a tree's first n nodes needed those issued at s <= n
        self.calls: list[tuple[int, int]] = []

    @property
    def compiled(self) -> bool:
        """Whether the step on the device's programs run compiled (`dyspec.core.programs`): where its
        session's do."""
        return self.kv is not None and self.kv.compiled

    @property
    def forwards(self) -> int:
        return self.kv.forwards if self.kv is not None else 0

    @torch.inference_mode()  # features reach a compiled draft as inference tensors, as its graphs were made
    def set_prompt_features(self, hidden: torch.Tensor | None) -> None:
        """The target's features (`target_features`) at the prompt's tokens but the last (None for a 1-token
        prompt): the first token reads zeros, every later one its predecessor's feature. A draft
        that never read a first token (`reads_first_token`: EAGLE's) starts at the second."""
        if not self.needs_features:
            return
        if hidden is not None and not self.reads_first_token:
            self.pending, self.pending_features = self.pending[1:], hidden
            return
        zeros = torch.zeros(1, self.kv.model.feature_size, device=self.kv.device)
        self.pending_features = zeros if hidden is None else torch.cat([zeros, hidden])

    @torch.inference_mode()
    def read_prompt(self) -> None:
        """Forward the pending tokens but the root (the prompt, at prefill) into the cache now: not
        counted as a draft forward of the generation, as the target's prefill is not. A draft with no
        cache (`cacheless`) has nothing to keep of them."""
        n = len(self.pending) - 1
        if self.kv is None or self.cacheless or n < 1:
            return
        features = None if self.pending_features is None else self.pending_features[:n]
        self.kv.append(self.pending[:n], last_only=True, features=features)
        self.kv.forwards -= 1
        self.pending = self.pending[n:]
        if features is not None:
            self.pending_features = self.pending_features[n:]

    def _timed_forward(self, tree: Tree, nodes: list[int], *args, on_device: bool = False, **kwargs) -> torch.Tensor:
        """`on_device`: a step on the device's, which mixes copies as tensor ops and never waits for
        the device (its one host read does)."""
        if self.kv is None:
            raise RuntimeError("this policy needs a draft model, and none is loaded")
        t = time.perf_counter()
        logits = self.kv.forward(*args, **kwargs)
        if self.copy_weights:
            logits = self._mix_copies(tree, nodes, logits, on_device)
        if not on_device:
            sync(self.kv.device)
        self.seconds += time.perf_counter() - t
        # a tree on the device has room for every node: its size is the nodes of its rounds so far
        self.calls.append((tree.growth[-1] if isinstance(tree, TreeTensors) else len(tree), len(nodes)))
        return logits

    def _mix_copies(self, tree: Tree, nodes: list[int], logits: torch.Tensor, on_device: bool) -> torch.Tensor:
        """Each node's logits mixed with its copy (dyspec.core.copying.mix), widened to the target's
        vocabulary first where a copy is a token outside the draft's."""
        if isinstance(tree, TreeTensors):
            return self._mix_tree_copies(tree, nodes, logits)
        copies = [
            copy_token(self.context + array("i", [tree.tokens[a] for a in tree.path(node)]), self.copy_weights)
            for node in nodes
        ]
        vocab = self.vocab
        if on_device:  # widened always, as a tree's forwards are (`mix_tree_copies`): one shape for its programs
            device = logits.device
            table = torch.tensor(copies, dtype=torch.float64, device=device)  # token ids below 2^53: exact
            return mix_copies(logits, table, self.temperature, *self.vocab_columns(device), compiled=self.compiled)
        if vocab is not None and any(weight and vocab.column_of[token] < 0 for token, weight in copies):
            logits = vocab.widen(logits, float("-inf"))
        width = logits.shape[-1]
        columns = [token if vocab is None or not weight else vocab.column(token, width) for token, weight in copies]
        return mix(logits, columns, [weight for _, weight in copies], self.temperature)

    def _mix_tree_copies(self, t: TreeTensors, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`_mix_copies` of nodes `rows` (an index) of a tree on the device (`mix_tree_copies`)."""
        device = logits.device
        if self.context_tensor is None:  # the committed tokens change only at `commit`: copied once a step
            self.context_tensor = torch.frombuffer(self.context, dtype=torch.int32).to(device, torch.long)
        if self.copy_table is None:
            self.copy_table = torch.tensor([0.0, *self.copy_weights], dtype=torch.float64, device=device)
        copied = (self.context_tensor, t.ancestors, t.depths, t.tokens, rows, self.copy_table, self.temperature)
        return mix_tree_copies(logits, *copied, *self.vocab_columns(device), compiled=self.compiled)

    @property
    def hidden(self) -> torch.Tensor:
        """The draft's final hidden states [n, H] of the nodes in the last `logits` call."""
        return self.kv.hidden

    @torch.inference_mode()
    def logits(self, tree: Tree, nodes: list[int], on_device: bool = False) -> torch.Tensor:
        """Draft logits [len(nodes), V] after each of `nodes`, in one forward with tree attention; V is
        the draft's vocabulary (`vocab`) or, in a call that copies a token outside it, the target's.
        Node 0 (the root) comes alone, first, once per step; every other node's ancestors are the
        root, nodes forwarded earlier this step, or nodes earlier in `nodes`. `on_device`: the root's
        forward in a step on the device (`_timed_forward`)."""
        if nodes == [0]:
            logits = self._timed_forward(
                tree, nodes, self.pending, last_only=True, features=self.pending_features, on_device=on_device
            )
            self.kv.commit(list(range(self.kv.length, self.kv.length + len(self.pending))))
            self.pending = []
            if self.needs_features:
                self.pending_features = self.pending_features[:0]
                self.node_features[0] = self.hidden[-1]
            return logits
        start = self.kv.cached
        col = {node: start + i for i, node in enumerate(nodes)}
        col.update(self.slot_of)
        visible = np.zeros((len(nodes), start - self.kv.length + len(nodes)), dtype=bool)  # numpy: see Tree
        for i, node in enumerate(nodes):
            visible[i, [col[a] - self.kv.length for a in tree.path(node)]] = True
        positions = [self.kv.length - 1 + tree.depths[node] for node in nodes]
        features = None
        if self.needs_features:
            features = torch.stack([self.node_features[tree.parents[node]] for node in nodes])
        tokens = [tree.tokens[node] for node in nodes]
        logits = self._timed_forward(tree, nodes, tokens, positions, torch.from_numpy(visible), features=features)
        self.slot_of.update((node, start + i) for i, node in enumerate(nodes))
        if self.needs_features:
            self.node_features.update(zip(nodes, self.hidden))
        return logits

    @torch.inference_mode()
    def tree_logits(self, t: TreeTensors, nodes: list[int] | torch.Tensor) -> torch.Tensor:
        """`logits` after `nodes` of a tree grown on the device (dyspec.core.tree_tensors), with no host
        read: every ancestor of theirs but the root was forwarded this step, in earlier calls.
        `nodes` may be chosen on the device (an index tensor); `place` learns the slots once read."""
        start, length, device = self.kv.cached, self.kv.length, t.tokens.device
        rows = nodes if isinstance(nodes, torch.Tensor) else index_on(nodes, device)
        self.tree_slots.append((start, rows))
        # each row's ancestors among this step's slots, which a padded forward leaves gaps between
        columns = index_on([s - length + i for s, r in self.tree_slots for i in range(len(r))], device)
        # a feature draft's table of features, the last call's placed in the next call's program
        features = None
        if self.needs_features:
            features = (self.tree_features, self.node_features[0], *(self.unplaced or (None, None)))
        mask_at = self.kv.tree_mask_at(len(rows))
        args = (t.ancestors, t.depths, t.tokens, t.parents, rows, self.forwarded_rows, columns, mask_at)
        ids, mask, self.forwarded_rows, features, self.tree_features = tree_inputs(
            *args, features, compiled=self.compiled
        )
        logits = self._timed_forward(t, rows, ids, features=features, mask=mask, on_device=True)
        if self.needs_features:
            self.unplaced = rows, self.hidden
        return logits

    def vocab_columns(self, device: torch.device) -> tuple[torch.Tensor | None, int]:
        """The reduced vocabulary as programs take it: its token ids (`DraftVocab.ids`) on `device`,
        kept, and the target's vocabulary size; (None, 0) where the draft reads out every token."""
        if self.vocab is None:
            return None, 0
        return self.vocab.ids_on(device), self.vocab.size

    def place(self, forwarded: list[int]) -> None:
        """`forwarded`, as the step read it: the tree nodes' cache slots, for `commit`."""
        slots = [start + i for start, rows in self.tree_slots for i in range(len(rows))]
        self.slot_of = dict(zip(map(int, forwarded), slots))

    def relabel(self, old_ids: list[int]) -> None:
        """The tree was renumbered (pruned): new node i was old node old_ids[i] (ascending). A forward
        issued at size s then was issued at the new tree's count of nodes below s: `--budget auto`
        prices a tree's first n nodes by the forwards they needed."""
        self.slot_of = {new: self.slot_of[old] for new, old in enumerate(old_ids) if old in self.slot_of}
        self.calls = [(bisect.bisect_left(old_ids, size), rows) for size, rows in self.calls]

    @torch.inference_mode()
    def commit(
        self, tree: Tree, accepted: list[int], next_token: int, target_hidden: torch.Tensor | None = None
    ) -> None:
        """Keep the accepted path. `target_hidden` [len(tree), feature width] are the target's features at
        the tree's nodes (`target_features`, needed by feature drafts)."""
        seen = 0
        while not self.needs_features and seen < len(accepted) and accepted[seen] in self.slot_of:
            seen += 1
        if self.needs_features and self.reads:
            path = [0, *accepted]  # a child's id is above its parent's: a path ending at len - 1 is 0..len - 1
            rows = target_hidden[: len(path)] if path[-1] == len(path) - 1 else target_hidden[path]
            self.pending_features = torch.cat([self.pending_features, rows]) if len(self.pending_features) else rows
            self.node_features, self.tree_features, self.unplaced = {}, None, None
        if self.kv is not None and self.slot_of:
            self.kv.commit([self.slot_of[node] for node in accepted[:seen]])
        self.pending += [tree.tokens[node] for node in accepted[seen:]] + [next_token]
        self.context.extend([tree.tokens[node] for node in accepted] + [next_token])
        self.slot_of, self.tree_slots, self.context_tensor, self.forwarded_rows = {}, [], None, None
        self.calls = []
