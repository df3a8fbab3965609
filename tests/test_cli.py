"""The CLI as a user runs it: clear one-line errors, JSON output."""

import json
import subprocess
import sys

import pytest

from dyspec.auto.profile import DEFAULT_SIZES, FIRST_SIZES, LONG_CONTEXT, LONG_SIZES, weight_bytes
from dyspec.defaults import defaults_for
from dyspec.eval.anatomy import ANATOMY_STEPS
from dyspec.forward.quant import quantize_int8
from dyspec.kernels.int8_mm import kernel_path

from .tiny import fresh_cache, tiny_model, tiny_tokenizer

# The default target made ready first: a first load (a clean machine) prints the GGUF conversion's
# progress on stderr, which is not what these tests read.
pytestmark = pytest.mark.usefixtures("pair")


def dyspec(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dyspec", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dyspec: error:"), result.stderr
    for f in fragments:
        assert f in lines[0]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--budget", "0"], "budget"),
        (["--budget", "100000"], "budget"),
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "0"], "max new tokens"),
        (["--policy", "nope"], "unknown policy"),
        (["--policy", "specinfer", "--option", "expansion=2,x"], "expansion"),
        (["--policy", "specinfer", "--budget", "auto", "--option", "expansion=2,1"], "option expansion fixes it"),
        (["--policy", "dyspec", "--option", "auto_rates=[1]"], "no option auto_rates"),  # the engine's, not a user's
        (["--target", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
        (["--target", "/no/such/folder"], "not found"),
        (["--device", "cuda"], "cuda"),
        (["--budget", "abc"], "budget"),
        (["--draft", "int8,,truncated:2"], "draft list"),
    ],
)
def test_bad_input_is_one_clear_line(args, fragment):
    assert_one_line_error(dyspec("generate", "--prompt", "hi", *args), fragment)


def test_bench_out_must_be_a_file(tmp_path):
    """A folder given for the records failed with a traceback after the models had loaded."""
    assert_one_line_error(dyspec("bench", "--out", str(tmp_path)), "is a folder", "results.jsonl")


def test_prompt_longer_than_context():
    assert_one_line_error(dyspec("generate", "--prompt", "word " * 9000, "--max-new-tokens", "4"), "context")


def test_mismatched_vocabularies(tmp_path):
    tiny_model(0).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    assert_one_line_error(dyspec("generate", "--prompt", "hi", "--draft", str(tmp_path / "tiny")), "vocabulary")


def test_profile_table_puts_the_baseline_under_its_sizes_and_saves_the_profile(tmp_path, monkeypatch):
    """The table, and the profile saved where `--budget auto` reads it (measured again on demand)."""
    tiny_model(0).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    fresh_cache(monkeypatch, tmp_path / "cache", shared=("kernels", "graphs"))
    r = dyspec("profile", "--target", str(tmp_path / "tiny"), "--draft", str(tmp_path / "tiny"))
    assert r.returncode == 0, r.stderr
    (saved,) = (tmp_path / "cache" / "profiles").iterdir()
    assert list(json.loads(saved.read_text())["target"]) == [str(n) for n in DEFAULT_SIZES] and str(saved) in r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["n"])
    # the lean default beside the Hugging Face forward; llama.cpp runs GGUF files only
    assert lines[header].split() == ["n", "target", f"@{LONG_CONTEXT}", "draft", "1st-draft", "HF", "fp32", "HF"]
    assert "llama.cpp not measured" in r.stderr
    floor = next(i for i, line in enumerate(lines) if line.startswith("t(1) against the floor"))
    rows = {line[:4].strip(): line[4:] for line in lines[header + 1 : floor]}
    assert list(rows) == [str(n) for n in DEFAULT_SIZES]
    model = tiny_model(0)  # target and draft, int8 where the CLI's precision is
    int8 = json.loads(saved.read_text())["precision"] == "int8"
    mb = weight_bytes(quantize_int8(model) if int8 else model) / 1e6
    step = next(i for i, line in enumerate(lines) if line.startswith("a step on an MT-Bench question"))
    assert [line.split(":")[0].strip() for line in lines[floor + 1 : step]] == ["target", "draft"]
    assert all(f"({mb:.3g} MB)" in line for line in lines[floor + 1 : step])
    # where a step of the default policy went, beside ar's
    default = defaults_for("cpu", kernel_path() if int8 else None)
    assert lines[step].startswith(f"a step on an MT-Bench question, {default.text} (the")
    # then each policy's ops and host reads a step, ar's read its next token
    table = lines[step + 2 :]
    assert [line.split("`")[1] for line in table[2:]] == [f"{p}@{b}" for p, b in ANATOMY_STEPS]
    assert table[2].split("|")[3].strip() == "1"
    assert "ms in the target's forward" in lines[step] and "ar's step:" in lines[step]
    # the long context's, a step's first draft forward's, HF's, fp32's
    for column, sizes in ((1, LONG_SIZES), (3, FIRST_SIZES), (4, LONG_SIZES), (5, (1, 8))):
        cells = {n: row[10 * column : 10 * (column + 1)].strip() for n, row in rows.items()}
        assert all((float(cells[n]) > 0) if int(n) in sizes else cells[n] == "" for n in cells)
    assert all(float(row[:10]) > 0 and float(row[20:30]) > 0 for row in rows.values())


def test_generate_json():
    r = dyspec(
        "generate", "--prompt", "Say hello.", "--policy", "dyspec", "--budget", "8", "--max-new-tokens", "8", "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for field in (
        "text",
        "new_tokens",
        "target_forwards",
        "tokens_per_forward",
        "wall_s",
        "tokens_per_s",
        "policy",
        "budget",
        "temperature",
        "token_ids",
    ):
        assert field in out
    assert out["new_tokens"] == len(out["token_ids"]) == 8 and out["policy"] == "dyspec"


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--corpus", "sharegpt,continuations", "--num-prompts", "1,2,3"], "3 prompt counts for 2 corpora"),
        (["--corpus", "sharegpt,sharegpt"], "each corpus once"),
        (["--num-prompts", "x"], "comma-separated"),
        (["--corpus", "sharegpt:x"], "conversation number"),
        (["--feature-layers", "40"], "lower layers are 0 to 29"),
        (["--init", "no-such-draft"], "must be a folder made by `dyspec distill`"),
        (["--draft-layers", "0"], "at least one decoder layer"),
    ],
)
def test_distill_bad_corpus_list_is_one_clear_line(tmp_path, args, fragment):
    assert_one_line_error(dyspec("distill", "--out", str(tmp_path / "out"), *args), fragment)
    assert not (tmp_path / "out").exists()  # nothing was made


def test_train_head_and_distill_run_from_the_command_line(tmp_path):
    """Both training commands end to end on a tiny pair: arguments reach the functions."""
    tiny_model(0).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    tiny = str(tmp_path / "tiny")
    head = dyspec(
        "train-head",
        "--target",
        tiny,
        "--draft",
        tiny,
        "--out",
        str(tmp_path / "h"),
        "--num-prompts",
        "20",
        "--max-new-tokens",
        "6",
        "--epochs",
        "1",
        "--eval-prompts",
        "2",
        "--device",
        "cpu",
    )
    assert head.returncode == 0, head.stderr
    assert (tmp_path / "h" / "head.safetensors").is_file()
    distilled = dyspec(
        "distill",
        "--target",
        tiny,
        "--out",
        str(tmp_path / "d"),
        "--num-prompts",
        "20",
        "--max-new-tokens",
        "6",
        "--steps",
        "2",
        "--batch",
        "2",
        "--draft-vocab",
        "4",
        "--copy-prompts",
        "10",
        "--draft-layers",
        "2",
        "--unroll",
        "3",
    )
    assert distilled.returncode == 0, distilled.stderr
    report = json.loads(distilled.stdout)
    assert report["settings"]["num_prompts"] == 20 and report["copy"]["prompts"] == 10
    assert report["settings"]["draft_layers"] == 2 and report["settings"]["unroll"] == 3
    # the copy weights fitted again, on more answers, by the command that does only that
    draft = tmp_path / "d" / "draft"
    out = str(tmp_path / "c")
    args = ("--draft", str(draft), "--out", out, "--num-prompts", "12", "--eval", "mtbench", "--eval-prompts", "3")
    args += ("--spread",)  # 3 of MT-Bench's 80 questions, evenly spaced
    fitted = dyspec("fit-copy", "--target", tiny, *args)
    assert fitted.returncode == 0, fitted.stderr
    refit = json.loads(fitted.stdout)
    assert refit["prompts"] == 12 and len(refit["weights"]) == 6
    assert refit["eval"]["dataset"] == "mtbench" and refit["eval"]["positions"] > 0 and refit["eval"]["spread"]
    assert len(refit["eval"]["by_depth"]) == 4 and refit["eval"]["by_depth"][0] == refit["eval"]["agreement"]["draft"]
    assert len(list((tmp_path / "c").glob("eval-mtbench-spread3-*.jsonl"))) == 1  # not the first-3 answers
    assert json.loads((draft / "feature_draft.json").read_text())["copy_weights"] == refit["weights"]
    # fine-tuned from that draft, on the target's greedy and sampled answers
    args = ("--out", str(tmp_path / "ft"), "--from", str(draft), "--corpus", "answers", "--draft-layers", "2")
    args += ("--num-prompts", "20", "--max-new-tokens", "6", "--steps", "1", "--batch", "2", "--copy-prompts", "0")
    tuned = dyspec("distill", "--target", tiny, *args)
    assert tuned.returncode == 0, tuned.stderr
    assert json.loads(tuned.stdout)["settings"]["init"] == str(draft)
    answers = [json.loads(line) for line in (tmp_path / "ft" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 20 and {a["temperature"] for a in answers} == {0.0, 0.7}
    # and its vocabulary's size chosen by measurement, for a setting of the user's
    args = ("--draft", str(draft), "--out", str(tmp_path / "v"), "--num-prompts", "6", "--max-new-tokens", "6")
    chosen = dyspec("draft-vocab", "--target", tiny, *args, "--sizes", "2,4", "--policy", "chain", "--budget", "2")
    assert chosen.returncode == 0, chosen.stderr
    assert "chain at budget 2, replayed on 1 held-out answers" in chosen.stdout and "(best)" in chosen.stdout
    report = json.loads((tmp_path / "v" / "report.json").read_text())
    assert [row["draft_vocab"] for row in report["candidates"]] == [4, 2]
    assert f"draft: {report['best']['folder']}" in chosen.stderr


def test_fit_copy_needs_a_feature_draft(tmp_path):
    assert_one_line_error(dyspec("fit-copy", "--out", str(tmp_path), "--draft", "int8"), "--draft must be", "int8")
    assert_one_line_error(dyspec("fit-copy", "--out", str(tmp_path), "--num-prompts", "2"), "at least 5 prompts")
    assert_one_line_error(dyspec("draft-vocab", "--out", str(tmp_path), "--draft", "int8"), "--draft must be", "int8")


def test_replay_sweep_records_table_and_page(tmp_path):
    """`dyspec replay`: a record per prompt, policy and budget; the table's nodes and tokens per
    forward are the records' totals (a tree is full but at an answer's last token, where it is the
    root alone); `dyspec report` makes a results page from them, each speedup labelled modelled. A
    policy with options (`dyspec:batch=1`, the paper's one node a draft forward) is its own setting."""
    out = tmp_path / "replay.jsonl"
    r = dyspec(
        "replay", "--dataset", "mtbench", "--num-prompts", "2", "--max-new-tokens", "16",
        "--policies", "chain,dyspec,dyspec:batch=1", "--budgets", "2,16", "--whatif", "h100", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 * 3 * 2 and {x["kind"] for x in records} == {"replay"}
    forwards = {
        p: sum(x["draft_forwards"] for x in records if x["policy"] == p and x["budget"] == 16)
        for p in ("dyspec", "dyspec:batch=1")
    }
    assert forwards["dyspec:batch=1"] > forwards["dyspec"]
    assert all(x["command"].startswith("dyspec replay") for x in records)
    rows = [line.strip("|").split("|") for line in r.stdout.splitlines()[2:]]
    for policy, budget, *_ in rows:
        mine = [x for x in records if x["policy"] == policy.strip() and x["budget"] == int(budget)]
        forwards = sum(x["target_forwards"] for x in mine)
        npf, tpf = (sum(x[key] for x in mine) / forwards for key in ("tree_nodes", "new_tokens"))
        assert 0 < npf <= int(budget)
        assert f"| {policy.strip()} | {budget.strip()} | 2 | {npf:.1f} | {tpf:.2f} |" in r.stdout
    assert "modelled on H100" in r.stdout.splitlines()[0] and "not measured" in r.stderr
    page = dyspec("report", str(out), "--whatif", "h100", "--title", "Replay")
    assert page.returncode == 0 and "not measured" in page.stdout and "| chain | 16 | 2 |" in page.stdout
    assert_one_line_error(dyspec("replay", "--prompt", "hi", "--budgets", "300"), "budget")
    assert_one_line_error(dyspec("replay", "--prompt", "hi", "--policies", "dyspec:batch"), "bad policy spec")


def test_profile_steps_takes_the_settings_to_count():
    from dyspec.cli import build_parser

    args = build_parser().parse_args(["profile", "--steps", "--policies", "dyspec:step=device@16,ar@1,chain@auto"])
    assert args.policies == (("dyspec:step=device", 16), ("ar", 1), ("chain", "auto"))
    for bad in ("dyspec16", "dyspec@0", "@4", "chain@four", "chain@Auto"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["profile", "--steps", "--policies", bad])
