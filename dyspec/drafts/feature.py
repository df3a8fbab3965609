"""A feature-conditioned draft in the manner of EAGLE (Li et al. 2024): one decoder layer (or more) that
reads the target's final hidden state (after its final norm) at position j - 1 together with the embedding of token j,
predicts the target's hidden state at j, and reads it out through the target's own output layer,
cut to the most frequent tokens (the output layer is most of a small draft's cost).

It borrows the target's embedding and output rows instead of storing them, so a trained draft is
small (a few MB in fp16). The engine feeds it the target's hidden states of the accepted path
(`needs_features`); inside a tree, a node's input feature is the draft's own prediction at its
parent. Exactness never depends on the draft: verification only uses the q it proposed from.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from dyspec.core.copying import MATCHES
from dyspec.core.kv import FINAL, Output, cache_kwarg
from dyspec.errors import DyspecError
from dyspec.forward import lean_graph
from dyspec.forward.lean import LeanCache, lean_dims, lean_layers, role_cache, rotary_rows, rotary_table, run_layers
from dyspec.forward.quant import Int8Linear, SplitInt8Linear, quantize_int8

CONFIG_NAME = "feature_draft.json"
WEIGHTS_NAME = "feature_draft.safetensors"


class FeatureDraft(nn.Module):
    needs_features = True
    copy_weights: list[float] | None = None  # per match length (dyspec.core.copying), fitted by `dyspec distill`
    # the prompt's first token, read with a zero feature; EAGLE's published drafts skip it (dyspec.drafts.eagle)
    reads_first_token = True
    runs_lean = True  # its decoder layers can run as the lean forward's (`use_lean`)
    cacheless = False
    lean_layers: list | None = None
    graph: lean_graph.CompiledLayers | None = None  # `compile_layers`

    def __init__(
        self,
        target: PreTrainedModel,
        vocab: torch.Tensor,
        feature_layers: tuple[int, ...] = FINAL,
        num_layers: int = 1,
        fc_bias: bool = False,
        first_norm: bool = True,
    ):
        """`fc_bias` and `first_norm` (the first layer's input norm) as a checkpoint was trained
        with: dyspec's own drafts have no bias and the norm; EAGLE's have a bias and no norm."""
        super().__init__()
        if not feature_layers or feature_layers[-1] != -1 or len(set(feature_layers)) < len(feature_layers):
            raise DyspecError(f"a feature draft reads distinct target layers, -1 (final) last; got {feature_layers}")
        if num_layers < 1:
            raise DyspecError(f"a feature draft has at least one decoder layer, got {num_layers}")
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
        config._attn_implementation = "sdpa"
        self.config = config
        decoder = target.get_decoder()
        H = config.hidden_size
        self.feature_layers = tuple(feature_layers)
        # EAGLE-3's fusion: the target's states at lower layers (`feature_layers`) mixed into its final one
        self.fuse = nn.Linear(len(feature_layers) * H, H, bias=False) if len(feature_layers) > 1 else None
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList(type(decoder.layers[0])(config, i) for i in range(num_layers))
        if not first_norm:  # its input x = fc(...) is already at the scale it was trained at
            self.layers[0].input_layernorm = nn.Identity()
        self.layer_cache_kwarg = cache_kwarg(self.layers[0].forward)  # once: inspecting a signature is slow
        self.rotary = type(decoder.rotary_emb)(config)
        self.register_buffer("vocab", vocab.long(), persistent=False)
        # Borrowed from the target, frozen and not saved: the embedding and the output rows.
        self.borrowed = SimpleNamespace(
            embed=target.get_input_embeddings(),
            head=target.get_output_embeddings().weight.detach()[vocab.long()].clone(),
            int8_head=None,  # the output rows as an Int8Linear (`quantize_int8`)
        )

    @property
    def device(self) -> torch.device:
        return self.fc.device if isinstance(self.fc, SplitInt8Linear) else self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype if isinstance(self.fc, SplitInt8Linear) else self.fc.weight.dtype

    @property
    def feature_size(self) -> int:
        """Width of the target features it reads (`target_features` at `feature_layers`)."""
        return len(self.feature_layers) * self.config.hidden_size

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Its input feature [..., H]: the target's features [..., feature_size] fused, the lower
        layers' states RMS-normed first (their scale grows with depth; the final one is normed
        already); a feature of width H (its own prediction, inside a tree) passes as it is."""
        H = self.config.hidden_size
        if self.fuse is None or features.shape[-1] == H:
            return features.to(self.dtype)
        lower = nn.functional.rms_norm(features[..., :-H].unflatten(-1, (-1, H)).float(), (H,)).flatten(-2)
        return self.fuse(torch.cat([lower, features[..., -H:].float()], dim=-1).to(self.dtype))

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Start as the identity on the feature: the target's last layer with its two output
        projections zeroed (so the residual stream passes through, at the scale of the target's
        normed features, instead of adding deltas sized for its un-normed residual stream), fed the
        feature alone (the projection is the identity on the feature half). Of the target's layers the
        last one learns fastest from; without the zeroing, training starts from a loss far above a
        fresh draft's."""
        H = self.config.hidden_size
        with torch.no_grad():
            for layer in self.layers:  # each the identity at first, so a deeper draft starts as a shallower one
                layer.load_state_dict(target.get_decoder().layers[-1].state_dict())
                for name, module in layer.named_modules():
                    if name.endswith(("o_proj", "down_proj")):
                        module.weight.zero_()
            self.fc.weight.zero_()
            self.fc.weight[:, :H] = torch.eye(H)
            if self.fuse is not None:  # the identity on the final layer's state: a final-layer draft at first
                self.fuse.weight.zero_()
                self.fuse.weight[:, -H:] = torch.eye(H)

    def quantize_int8(self) -> None:
        """The CPU fast path (`--precision int8`): the decoder layer and the output rows in int8,
        several times faster than fp32 GEMMs of a few rows, with the same acceptance. Exactness
        never depends on the draft."""
        # `fc` reads [feature, embedding], whose halves differ widely in scale: each half gets its own
        # int8 scale per row (`SplitInt8Linear`). `fuse` runs once a step: it stays as it is.
        for layer in self.layers:
            quantize_int8(layer)
        self.fc = SplitInt8Linear(self.fc, self.config.hidden_size)
        self.borrowed.int8_head = Int8Linear(self.borrowed.head)

    def use_lean(self) -> None:
        """Decode with its decoder layers run as the lean forward runs a target's (dyspec.forward.lean)
        over a LeanCache (`cache_for`): the Hugging Face layer's masks, rotary module and cache
        bookkeeping cost more than its products at one token. Training and a growing cache keep the
        Hugging Face layers."""
        if self.lean_layers is not None:
            return
        self.dims = lean_dims(self.config)
        self.cos, self.sin = rotary_table(self.rotary, self.config.max_position_embeddings, self.dtype)
        self._caches: dict[str, LeanCache] = {}
        self.lean_layers = lean_layers(self.layers)

    def compile_layers(self) -> None:
        """Run its lean layers and output rows compiled, as a compiled target runs its own
        (dyspec.forward.lean_graph), compiled now; once. Only int8 layers that each have an input
        norm compile (an EAGLE draft's first layer has none: it stays eager)."""
        if self.graph is not None or self.borrowed.int8_head is None or not lean_graph.supported():
            return
        if any(layer.attn_norm is None or not isinstance(layer.qkv, Int8Linear) for layer in self.lean_layers):
            return
        self.graph = lean_graph.CompiledLayers(self.lean_layers, self.dims, self.borrowed.int8_head)
        # what the one-graph forward reads besides its layers: the embedding, fc's two int8 halves
        self.graph_inputs = (self.borrowed.embed.weight, *map(lean_graph.linear_operands, self.fc.parts))
        lean_graph.warm_up(self, self.config.vocab_size)

    def cache_for(self, role: str) -> LeanCache:
        return role_cache(self, role)

    def subset_logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits over `vocab` only, [..., len(vocab)], through the target's output rows. Features are
        the target's final hidden states as Hugging Face returns them (after the final norm), so the
        output layer applies directly."""
        if self.graph is not None:
            return self.graph.logits(feature.reshape(-1, feature.shape[-1])).view(*feature.shape[:-1], -1)
        if self.borrowed.int8_head is not None:
            return self.borrowed.int8_head(feature)
        return feature @ self.borrowed.head.T.to(feature.dtype)

    def predict(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted target hidden states [B, n, H] for inputs (features [B, n, feature_size] from the
        target or [B, n, H] its own predictions, input_ids [B, n]); `slots` as `run_layers` takes them."""
        embedded = self.borrowed.embed(input_ids).detach().to(self.dtype)  # the target's, frozen
        feature = self.fused(features)
        if self.graph is None:
            x = self.fc(torch.cat([feature, embedded], dim=-1))
        else:  # fc as its one graph runs it (`draft_block`), so that every forward drafts alike
            x = lean_graph.split_linear(feature.flatten(0, 1), embedded.flatten(0, 1), *self.graph_inputs[1:])
            x = x.view(*feature.shape[:-1], -1)
        if isinstance(cache, LeanCache):
            n, start = x.shape[1], cache.length
            cache.reserve(n)
            cos, sin = rotary_rows(self, position_ids, start + n)
            if self.graph is not None and self.graph.takes(n, start, attention_mask):
                x = self.graph.forward(x[0], cos, sin, cache, start, attention_mask)[0]
            else:
                x = run_layers(
                    self.lean_layers, x[0], cos, sin, cache, start, attention_mask, self.dims, False, slots=slots
                )
            cache.length = start + n
            return x[None]
        # one token over the cache sees all of it: no mask, so SDPA runs as the lean layers call it
        if attention_mask is None and input_ids.shape[1] > 1:
            attention_mask = causal_mask(input_ids.shape[1], cache, x)
        rotary = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(
                x,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                position_embeddings=rotary,
                **{self.layer_cache_kwarg: cache},
            )
        return x

    def reads_in_one_graph(self, n: int, features: torch.Tensor, mask, cache, slots) -> bool:
        """Whether a forward runs as one compiled graph (`graph_forward`): a decoding forward (its
        cache holds tokens) of compiled layers, reading one feature width (no fusion to run)."""
        return (
            self.graph is not None
            and isinstance(cache, LeanCache)
            and cache.length > 0
            and slots is None
            and features.shape[-1] == self.config.hidden_size
            and self.graph.takes(n, cache.length, mask)
        )

    def graph_forward(self, input_ids, features, position_ids, mask, cache: LeanCache) -> tuple:
        """`predict` and the output rows of every row in one graph (dyspec.forward.lean_graph.draft_block):
        the predicted features [1, n, H] and logits [n, len(vocab)]."""
        n, start = input_ids.shape[1], cache.length
        cache.reserve(n)
        cos, sin = rotary_rows(self, position_ids, start + n)
        features = features[0].to(self.dtype)
        if not features.is_inference():  # a graph's guards tell them apart: it was made for one
            features = features.clone()
        h, logits = self.graph.draft(input_ids[0], features, self.graph_inputs, cos, sin, cache, start, mask)
        cache.length = start + n
        return h[None], logits

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        input_features: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        draft_vocab: bool = False,
        slots: torch.Tensor | None = None,
        **_,
    ) -> Output:
        """The interface KVSession uses (as a Hugging Face causal LM): full-vocabulary logits, -inf
        outside `vocab` (with `draft_vocab`, over `vocab` alone: dyspec.core.vocab), and the predicted
        feature as the last hidden state. Without `input_features` (latency profiling) the features
        are zeros."""
        if input_features is None:
            input_features = torch.zeros(*input_ids.shape, self.feature_size, device=self.device)
        if self.reads_in_one_graph(input_ids.shape[1], input_features, attention_mask, cache, slots):
            feature, logits = self.graph_forward(input_ids, input_features, position_ids, attention_mask, cache)
            logits = kept_rows(logits[None], logits_to_keep)
        else:
            feature = self.predict(input_ids, input_features, position_ids, attention_mask, cache, slots)
            logits = self.subset_logits(kept_rows(feature, logits_to_keep))
        logits = logits.float()
        if not draft_vocab:
            full = torch.full((*logits.shape[:2], self.config.vocab_size), float("-inf"), device=logits.device)
            logits = full.index_copy_(-1, self.vocab, logits)
        return Output(logits=logits, hidden_states=(feature,))


def kept_rows(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of x [1, n, ...] that `logits_to_keep` keeps, as Hugging Face reads it: a count from
    the end (0: all), or indices."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep]
    return x[:, -logits_to_keep:] if logits_to_keep else x


def causal_mask(n: int, cache, like: torch.Tensor) -> torch.Tensor:
    """The additive mask [1, 1, n, past + n] of n new tokens over a cache of `past` tokens and
    themselves, causal, in `like`'s dtype and device."""
    past = cache.get_seq_length() if cache is not None else 0
    keep = torch.ones(n, past + n, dtype=torch.bool, device=like.device).tril(past)
    mask = torch.zeros(keep.shape, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(~keep, torch.finfo(like.dtype).min)[None, None]


def features_before(hidden: torch.Tensor) -> torch.Tensor:
    """What each token of a sequence reads, given the target's hidden states at its tokens [L, H]:
    the state at the token before, zeros for the first."""
    return torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])


def save_feature_draft(draft: FeatureDraft, folder: Path, info: dict, dtype: torch.dtype = torch.float16) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in draft.state_dict().items()}
    tensors["vocab"] = draft.vocab.int().contiguous()
    save_file(tensors, folder / WEIGHTS_NAME)
    info = {"kind": "feature_draft", "feature_layers": list(draft.feature_layers), **info}
    (folder / CONFIG_NAME).write_text(json.dumps(info, indent=2))


def is_feature_draft(folder: Path) -> bool:
    return (folder / CONFIG_NAME).is_file()


def check_copy_weights(weights: list | None, folder: Path) -> list[float] | None:
    """A draft's copy weights (dyspec.core.copying) as its config stores them: none, or one per match
    length in [0, 1)."""
    if weights is not None and (len(weights) != MATCHES or not all(0 <= w < 1 for w in weights)):
        raise DyspecError(f"{folder / CONFIG_NAME}: copy_weights must be {MATCHES} numbers in [0, 1), got {weights}")
    return weights


def load_feature_draft(folder: Path, target: PreTrainedModel) -> FeatureDraft:
    """A draft saved by `dyspec distill`, attached to `target` (whose embedding and output it reads)."""
    info = json.loads((folder / CONFIG_NAME).read_text())
    tensors = load_file(folder / WEIGHTS_NAME)
    if info.get("hidden_size") != target.config.hidden_size or info.get("vocab_size") != target.config.vocab_size:
        raise DyspecError(
            f"draft {folder} was distilled for a target with hidden size {info.get('hidden_size')} and "
            f"{info.get('vocab_size')} tokens; this target has {target.config.hidden_size} and "
            f"{target.config.vocab_size}"
        )
    # drafts saved before drafts could have several decoder layers stored their one as `layer`
    tensors = {k.replace("layer.", "layers.0.", 1) if k.startswith("layer.") else k: v for k, v in tensors.items()}
    num_layers = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("layers."))
    draft = FeatureDraft(target, tensors.pop("vocab"), tuple(info.get("feature_layers", FINAL)), num_layers)
    draft.load_state_dict({k: v.to(target.dtype) for k, v in tensors.items()})
    draft.copy_weights = check_copy_weights(info.get("copy_weights"), folder)
    return draft.to(target.device).eval()
