import json
import operator
import os
import re
import signal
from pathlib import Path

import jsonschema
import pytest

from dyspec.auto.whatif import load_profile, modelled_speedup
from dyspec.errors import DyspecError
from dyspec.eval import speedup
from dyspec.eval.bench import (
    SCHEMA,
    BenchConfig,
    markdown_table,
    read_records,
    record_key,
    run_bench,
    write_report,
)
from dyspec.eval.prompts import load_prompts
from dyspec.eval.report import results_page
from dyspec.eval.summary import policy_label, summarize
from dyspec.kernels.int8_mm import kernel_path
from dyspec.load import load_pair


@pytest.fixture(scope="module")
def int8_draft_pair():
    """The fp32 target with its int8 copy as an independent draft, which hf-assisted can run."""
    return load_pair(draft="int8")


def test_bench_smoke_and_resume(int8_draft_pair, tmp_path):
    pair = int8_draft_pair
    assert pair.precision == "native" and pair.draft_name == "int8"
    out = tmp_path / "results.jsonl"
    config = BenchConfig(
        dataset="mtbench",
        num_prompts=2,
        policies=("ar", "chain", "dyspec", "hf", "hf-assisted", "hf-lookup"),
        budgets=(4,),
        max_new_tokens=16,
    )
    records = run_bench(pair, config, out, progress=False)
    assert len(records) == 2 * 6
    for r in read_records(out):
        jsonschema.validate(r, SCHEMA)
    ar = {r["prompt_id"]: r for r in records if r["policy"] == "ar"}
    for r in records:
        assert r["new_tokens"] == 16
        assert r["speedup_vs_ar"] is not None
        if r["policy"] in ("chain", "dyspec"):
            assert r["same_as_ar"] is True  # greedy: ar's tokens
            assert r["target_forwards"] <= ar[r["prompt_id"]]["target_forwards"]
            assert 0 < r["tree_build_s"] <= r["overhead_s"]
            assert 0 < r["tree_nodes"] <= 4 * r["target_forwards"] and r["draft_forwards"] > 0
            assert sum(r["calibration"]["reached"]) > 0
            assert r["step_ops"] > 0 and r["step_reads"] >= 1  # counted once per setting, in a run of its own
        if r["policy"] == "ar":
            assert r["step_reads"] == 1
        if r["policy"].startswith("hf"):
            assert "step_ops" not in r

    # An interrupted bench: a partial last line and a missing run; --resume runs only what is missing.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    resumed = run_bench(pair, config, out, resume=True, progress=False)
    assert len(resumed) == 2 * 6
    assert [record_key(json.loads(line)) for line in out.read_text().splitlines()] == [record_key(r) for r in records]

    report = tmp_path / "report.html"
    write_report(resumed, report, {"device": "cpu", "target": {"1": 60.0, "8": 110.0}, "target_at_400": {"1": 70.0}})
    html = report.read_text()
    assert "speedup vs ar" in html and "Draft probability vs acceptance" in html
    assert "Forward latency t(n)" in html and '"name":"target_at_400"' in html

    # the hardware what-if prices each row from its records' step shapes
    h100 = load_profile("h100")
    table = markdown_table(summarize(resumed), resumed, [h100]).splitlines()
    assert "modelled on H100" in table[0]
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[1] in ("chain", "dyspec", "ar"):
            rows = [r for r in resumed if r["policy"] == cells[1]]
            shapes = [tuple(s) for r in rows for s in r["step_shapes"]]
            assert cells[-1] == f"{modelled_speedup(shapes, h100):.2f}x"
        else:  # Hugging Face's generate: no steps to price
            assert cells[-1] == "-"
    write_report(resumed, report, whatif_models=[h100])
    assert "modelled on H100" in report.read_text()

    # a results page is made from the records alone, stamped with how they were made
    assert {r["command"] for r in resumed} == {None} and all(r["date"] and r["host"] for r in resumed)
    if pair.precision == "int8":  # a CPU's int8 products: the kernel path they ran on
        assert all(r["host"].endswith(f", int8 kernel {kernel_path()}") for r in resumed)
    page = results_page([out], "Smoke", [h100])
    first = resumed[0]
    assert page.startswith("# Smoke\n") and f"Host: {first['host']}; date: {first['date']}" in page
    assert "(not recorded)" in page and "| mtbench | dyspec | 4 |" in page and "modelled on H100" in page
    assert "| chain | 4 | 2 of 2 |" in page and "| dyspec | 4 | 2 of 2 |" in page  # greedy: ar's tokens, always
    with pytest.raises(DyspecError, match="no bench records"):
        results_page([tmp_path / "empty.jsonl"], "Empty")


def test_prompts_first_or_spread_over_the_set(tmp_path):
    first = [pid for pid, _ in load_prompts("mtbench", 10)]
    assert first == [f"mtbench/{i}" for i in range(81, 91)]  # MT-Bench's file is by category: all writing
    spread = [pid for pid, _ in load_prompts("mtbench", 8, spread=True)]
    assert spread == [f"mtbench/{i}" for i in range(81, 161, 10)]  # one per category
    assert len(load_prompts("mtbench", 500, spread=True)) == 80
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(7)))
    assert [text for _, text in load_prompts(str(path), 3, spread=True)] == ["p0", "p2", "p4"]


def test_one_pass_over_the_prompts_per_seed_ar_first_then_a_rotated_order(pair, tmp_path):
    config = BenchConfig(
        num_prompts=2, spread=True, policies=("ar", "chain"), budgets=(1, 2, 3), seeds=(0, 1), max_new_tokens=2
    )
    records = run_bench(pair, config, tmp_path / "results.jsonl", progress=False)
    order = [(r["seed"], r["prompt_id"], r["policy"], r["budget"]) for r in records]
    prompts = [pid for seed, pid, policy, _ in order if seed == 0 and policy == "ar"]
    assert prompts == ["mtbench/81", "mtbench/121"]  # spread: the first and the middle of 80
    budgets = [(1, 2, 3), (2, 3, 1), (3, 1, 2), (1, 2, 3)]  # each group starts one run further on
    assert order == [
        (seed, pid, policy, budget)
        for (seed, pid), rotated in zip([(s, p) for s in (0, 1) for p in prompts], budgets)
        for policy, budget in [("ar", 1), *[("chain", b) for b in rotated]]
    ]


def test_default_stands_for_the_devices_default_setting(pair):
    """`default` in --policies runs the device's default policy with its options, once even when its
    spec is also given, and a bench spec of the defaults reads back as them."""
    from dyspec.defaults import defaults_for
    from dyspec.eval.bench import plan_bench
    from dyspec.policies import parse_policy_spec

    default = defaults_for(pair.device)
    assert parse_policy_spec(default.spec) == (default.policy, dict(default.options))
    config = BenchConfig(num_prompts=1, policies=("ar", "default", default.spec), budgets=(2,), max_new_tokens=2)
    runs = [(policy, options, budget) for *_, policy, options, budget in plan_bench(pair, config)]
    assert runs == [("ar", {}, 1), (default.policy, dict(default.options), 2)]


def test_policy_specs_carry_options():
    from dyspec.errors import DyspecError
    from dyspec.eval.summary import summarize
    from dyspec.policies import parse_policy_spec

    assert parse_policy_spec("specdecpp:h=0.3:min_k=1") == ("specdecpp", {"h": 0.3, "min_k": 1})
    assert parse_policy_spec("chain") == ("chain", {})
    try:
        parse_policy_spec("specdecpp:h")
        raise AssertionError("a spec without a value must be refused")
    except DyspecError as e:
        assert "specdecpp:h" in str(e)
    base = {"dataset": "d", "prompt_id": "p", "budget": 4, "temperature": 0.0, "seed": 0, "target_forwards": 2}
    records = [
        {**base, "policy": "ar", "options": {}, "new_tokens": 8, "wall_s": 2.0},
        {**base, "policy": "specdecpp", "options": {"h": 0.3}, "new_tokens": 8, "wall_s": 1.0},
        {**base, "policy": "specdecpp", "options": {"h": 0.7}, "new_tokens": 8, "wall_s": 0.5},
    ]
    rows = {r["policy"]: r["speedup"] for r in summarize(records)}
    assert rows == {"ar": 1.0, "specdecpp:h=0.3": 2.0, "specdecpp:h=0.7": 4.0}


def test_the_table_says_where_a_step_went():
    """Milliseconds per target forward in the target, the drafts and the rest, summed over a row's
    records before dividing (a long run weighs more); peers, which do not time steps, show none."""
    from dyspec.eval.bench import markdown_table
    from dyspec.eval.summary import summarize

    base = {"dataset": "d", "budget": 4, "temperature": 0.0, "seed": 0, "options": {}, "new_tokens": 8}
    records = [
        {
            **base,
            "prompt_id": "p",
            "policy": "chain",
            "wall_s": 0.1,
            "target_forwards": 2,
            "target_s": 0.02,
            "draft_s": 0.01,
            "overhead_s": 0.004,
        },
        {
            **base,
            "prompt_id": "q",
            "policy": "chain",
            "wall_s": 0.1,
            "target_forwards": 6,
            "target_s": 0.06,
            "draft_s": 0.05,
            "overhead_s": 0.004,
        },
        {
            **base,
            "prompt_id": "p",
            "policy": "hf",
            "wall_s": 0.1,
            "target_forwards": 8,
            "target_s": None,
            "draft_s": None,
            "overhead_s": None,
        },
    ]
    rows = {r["policy"]: r for r in summarize(records)}
    assert rows["chain"]["step_ms"] == pytest.approx({"target": 10.0, "draft": 7.5, "overhead": 1.0})
    assert rows["hf"]["step_ms"] is None
    table = markdown_table(list(rows.values()))
    assert "| ms a step: target + draft + other |" in table
    assert "| 10.0 + 7.5 + 1.0 |" in table and table.splitlines()[-1].endswith("| - |")


def test_auto_is_compared_with_the_best_fixed_budget_per_prompt_and_seed():
    from dyspec.eval.bench import auto_table
    from dyspec.eval.summary import auto_vs_fixed, summarize

    def record(policy, budget, prompt, wall_s, new_tokens=10):
        return {
            "dataset": "mtbench",
            "policy": policy,
            "options": {},
            "budget": budget,
            "temperature": 0.6,
            "prompt_id": prompt,
            "seed": 0,
            "wall_s": wall_s,
            "new_tokens": new_tokens,
            "target_forwards": new_tokens,
            "tree_nodes": 0,
        }

    # budget 1 is the best fixed one; auto is 1.25x and 1.5x as fast per token on the two prompts
    # (on the second it stopped at 5 tokens: per token, not per answer), and has a run budget 1 lacks
    records = [record("ar", 1, p, 2.0) for p in ("a", "b")]
    records += [record("chain", 4, p, 3.0) for p in ("a", "b")] + [record("chain", 1, p, 1.5) for p in ("a", "b")]
    records += [record("chain", "auto", "a", 1.2), record("chain", "auto", "b", 0.5, new_tokens=5)]
    records += [record("chain", "auto", "c", 0.1)]
    rows = summarize(records)
    (c,) = auto_vs_fixed(records, rows)
    assert c["best_fixed"] == 1 and c["pairs"] == 2
    assert c["ratio"] == pytest.approx((1.25 * 1.5) ** 0.5)
    assert "| mtbench | chain | 0.6 | 1 | 2 | 1.369 | - |" in auto_table(records, rows)  # too few for an interval
    assert auto_table(records, [r for r in rows if r["budget"] == "auto"]) == ""
    # ten more prompts, on which auto is 1.25x and 1.5x as fast by turns: now an interval
    for i in range(10):
        records += [record("chain", 1, f"p{i}", 1.5), record("chain", "auto", f"p{i}", 1.2 if i % 2 else 1.0)]
    (c,) = auto_vs_fixed(records, summarize(records))
    assert c["pairs"] == 12 and 1.25 < c["low"] < c["ratio"] < c["high"] < 1.5


def test_llamacpp_baselines_fail_clearly_before_a_bench_starts(pair, tmp_path, monkeypatch):
    """Without the extra, or for a target that is no GGUF file, the bench says what to do and writes nothing."""
    import importlib.util

    from dyspec.eval import peers
    from dyspec.load import default_gguf
    from tests.tiny import tiny_pair

    assert peers.gguf_path(pair) == default_gguf() and default_gguf().is_file()
    out = tmp_path / "r.jsonl"
    config = BenchConfig(num_prompts=1, policies=("ar", "llamacpp"), budgets=(2,), max_new_tokens=4)
    with pytest.raises(DyspecError, match="not one: give --target FILE.gguf"):
        run_bench(tiny_pair(), config, out, progress=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a)
    )
    with pytest.raises(DyspecError, match=r'pip install -e "\.\[llamacpp\]"'):
        run_bench(
            pair, BenchConfig(num_prompts=1, policies=("llamacpp-lookup",), max_new_tokens=4), out, progress=False
        )
    assert not out.exists()


def crash(*_) -> None:
    """A peer that dies of SIGILL, as a llama.cpp built for another CPU does (called in its child)."""
    signal.raise_signal(signal.SIGILL)


def test_a_peers_child_returns_results_and_errors():
    from dyspec.eval import peers

    child = peers.Child("test")
    try:
        assert child.call(os.getpid) not in (os.getpid(), None)
        with pytest.raises(DyspecError, match="ZeroDivisionError"):
            child.call(operator.truediv, 1, 0)
        assert child.call(operator.add, 2, 3) == 5  # an error leaves the child serving
    finally:
        child.close()
    assert child.process.exitcode == 0


def test_a_crashing_peer_costs_its_rows_not_the_bench(pair, tmp_path, monkeypatch, capsys):
    """llama.cpp runs in a child process: its death (SIGILL here) leaves its rows out, says so once
    with what to do, and every other row is kept."""
    from dyspec.eval import bench, peers

    monkeypatch.setattr(bench, "check_llamacpp", lambda pair: None)  # no llama-cpp-python needed
    monkeypatch.setattr(bench, "LlamaCpp", lambda: peers.LlamaCpp(crash))
    config = BenchConfig(num_prompts=2, policies=("ar", "llamacpp", "chain"), budgets=(2,), max_new_tokens=4)
    records = run_bench(pair, config, tmp_path / "r.jsonl", progress=False)
    assert sorted(r["policy"] for r in records) == ["ar", "ar", "chain", "chain"]
    err = capsys.readouterr().err
    assert err.count("llama.cpp's process died of SIGILL") == 1 and "rebuild llama-cpp-python" in err


def test_llamacpp_baselines_run_beside_the_engine(pair, tmp_path):
    """With the extra installed (`pip install -e ".[llamacpp]"`), llama.cpp's rows are records like
    the others: the same prompts, speed against the same run's `ar`, in the results table."""
    pytest.importorskip("llama_cpp")
    config = BenchConfig(num_prompts=2, policies=("ar", "llamacpp", "llamacpp-lookup"), budgets=(4,), max_new_tokens=8)
    records = run_bench(pair, config, tmp_path / "r.jsonl", progress=False)
    for r in read_records(tmp_path / "r.jsonl"):
        jsonschema.validate(r, SCHEMA)
    assert sorted(r["policy"] for r in records) == [
        "ar",
        "ar",
        "llamacpp",
        "llamacpp",
        "llamacpp-lookup",
        "llamacpp-lookup",
    ]
    for r in records:
        assert 0 < r["new_tokens"] <= 8 and r["speedup_vs_ar"] > 0
    table = markdown_table(summarize(records), records)
    assert "| llamacpp |" in table and "| llamacpp-lookup |" in table


@pytest.mark.parametrize("variable", ["BENCH_POLICIES", "GPU_POLICIES", "GPU_DEVICE_POLICIES"])
def test_the_makefiles_benches_run_on_the_default_pair(default_pair, tmp_path, monkeypatch, variable):
    """`make bench` and `make gpu-check` name policies that run on the pair they load (hf-assisted,
    which needs an independent draft, once made `make bench` fail at once). Warm-ups as short as any
    setting's: what runs is the point here, not its clock."""
    monkeypatch.setattr(speedup, "AUTO_WARM_TOKENS", speedup.WARM_TOKENS)
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    policies = re.search(rf"^{variable} := (\S+)$", makefile, re.M).group(1).split(",")
    config = BenchConfig(num_prompts=1, policies=tuple(policies), budgets=(4, "auto"), max_new_tokens=2)
    records = run_bench(default_pair, config, tmp_path / "r.jsonl", progress=False)
    assert {r["policy"] for r in records} == {p.split(":")[0] for p in policies}
    assert {p for p in policies if p != "hf-assisted"} <= {policy_label(r) for r in records}  # options too
    # the default draft reads the target's features: hf-assisted runs with the target's int8 copy, and says so
    assisted = [r for r in records if r["policy"] == "hf-assisted"]
    assert ("hf-assisted" in policies) == bool(assisted)
    assert all(r["options"] == {"assistant": "int8"} for r in assisted)
