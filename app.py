"""dyspec web app: watch a token tree grow, get verified, and pay off against autoregressive decoding.

    python app.py [--host 127.0.0.1] [--port 7860] [--target ID] [--draft ID] [--device D] [--whatif-profile F]

The operator chooses the models when starting the app; a web user picks only among the built-in
policies, within limits (LIMITS), and never loads a path or remote code. Generations are queued:
at most `--concurrency` run at once (default 1: on a CPU, two at once only share the cores).
"""

from __future__ import annotations

import argparse

import gradio as gr

import dyspec
from dyspec.auto import whatif
from dyspec.core.events import GenerationFinished, StepVerified
from dyspec.defaults import defaults_for
from dyspec.errors import DyspecError
from dyspec.eval import speedup
from dyspec.eval.speedup import decode_rate, measured_speedup
from dyspec.export import VIEW_FORMATS, run_snippet
from dyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, PRECISIONS
from dyspec.policies import available_policies
from dyspec.views import figures
from dyspec.views.examples import EXAMPLES

LIMITS = {"max_new_tokens": 256, "budget": 64, "prompt_chars": 4000, "temperature": 2.0}


def check_limits(prompt: str, budget: int, temperature: float, max_new_tokens: int) -> None:
    if not prompt.strip():
        raise gr.Error("Type a prompt first.")
    if len(prompt) > LIMITS["prompt_chars"]:
        raise gr.Error(f"The prompt is limited to {LIMITS['prompt_chars']} characters here.")
    if not 1 <= budget <= LIMITS["budget"] or not 1 <= max_new_tokens <= LIMITS["max_new_tokens"]:
        raise gr.Error(f"Budget must be 1-{LIMITS['budget']} and max new tokens 1-{LIMITS['max_new_tokens']}.")
    if not 0 <= temperature <= LIMITS["temperature"]:
        raise gr.Error(f"Temperature must be between 0 and {LIMITS['temperature']}.")


def stats_markdown(steps: list[StepVerified], finished: GenerationFinished | None, ar: list[StepVerified]) -> str:
    tokens = sum(len(s.emitted) for s in steps)
    lines = [
        f"**{tokens} tokens in {len(steps)} target forwards** "
        f"({tokens / max(len(steps), 1):.2f} per forward), {decode_rate(steps):.1f} tokens/s while decoding"
    ]
    if ar:
        shown = speedup.speedup_text(steps, ar, final=finished is not None)
        lines.append(f"speedup vs ar: **{shown}**; {speedup.METHOD} (ar: {decode_rate(ar):.1f} tokens/s)")
    if finished is not None:
        lines.append(f"done ({finished.stop_reason}): {finished.wall_s:.2f} s wall, prefill included")
    return "\n\n".join(lines)


def slider_update(last: int, first: int, value: int | None = None):
    """Move a slider's range to [first, last] (a slider needs first < last) and its value to `value`."""
    return gr.update(maximum=max(last, first + 1), value=last if value is None else value)


def build_app(pair: dyspec.ModelPair, concurrency: int = 1, profiles: dict | None = None) -> gr.Blocks:
    """`profiles`: latency models the operator loaded for the what-if menu, besides the shipped
    ones, this machine's and a parametric accelerator."""
    policies = available_policies(pair)
    defaults = defaults_for(pair.device)
    default_policy = defaults.policy if defaults.policy in policies else "ar"
    hardware = {**whatif.shipped_models(), **(profiles or {})}
    choices = [*hardware, whatif.THIS_MACHINE, whatif.PARAMETRIC]
    ar_cache: dict = {}  # ar's steps per (prompt, settings), and which policies have run warm
    speedup.warm_up(pair, default_policy, defaults.budget, ar_cache)

    def whatif_markdown(steps, ar, choice, width, fraction) -> str:
        if not steps:
            return "Run a generation to price its trees."
        try:
            model = whatif.choose_model(choice, pair, hardware, int(width), float(fraction))
        except DyspecError as e:
            raise gr.Error(str(e)) from None
        here = measured_speedup(steps, ar) if ar else None
        measured = f"measured here: **{here.ratio:.2f}x**" if here else "measured here: (ar not measured)"
        return f"{measured} · **{whatif.whatif_line(steps, model)}**"

    def run(prompt, policy, budget, temperature, seed, max_new_tokens, measure_ar, choice, width, fraction):
        budget, seed, max_new_tokens = int(budget), int(seed), int(max_new_tokens)
        check_limits(prompt, budget, temperature, max_new_tokens)
        if policy not in policies:
            raise gr.Error(f"Unknown policy {policy!r}.")
        try:
            ar = []
            if measure_ar and policy != "ar":
                ar = speedup.ar_steps(pair, prompt, temperature, seed, max_new_tokens, ar_cache)
                speedup.warm_up(pair, policy, budget, ar_cache)
            ar_rate = decode_rate(ar) if ar else None
            steps: list[StepVerified] = []
            for event in dyspec.stream(
                pair,
                prompt,
                policy=policy,
                budget=budget,
                temperature=temperature,
                seed=seed,
                max_new_tokens=max_new_tokens,
            ):
                if isinstance(event, StepVerified):
                    steps.append(event)
                finished = event if isinstance(event, GenerationFinished) else None
                if steps and (finished or isinstance(event, StepVerified)):
                    yield (
                        figures.text_html(steps),
                        figures.tree_figure(steps[-1]),
                        figures.steps_figure(steps, speedup.running_speedup(steps, ar_rate) if ar_rate else None),
                        stats_markdown(steps, finished, ar),
                        (steps, ar),
                        slider_update(len(steps) - 1, 0),
                        slider_update(len(steps[-1].tokens), 1),
                        whatif_markdown(steps, ar, choice, width, fraction) if finished else gr.skip(),
                    )
        except DyspecError as e:
            raise gr.Error(str(e)) from None

    def show_step(state, index, growth):
        steps = state[0] if state else []
        if not steps:
            return gr.skip(), gr.skip()
        step = steps[min(int(index), len(steps) - 1)]
        upto = min(int(growth), len(step.tokens))
        return figures.tree_figure(step, upto), slider_update(len(step.tokens), 1, upto)

    def reprice(state, choice, width, fraction):
        steps, ar = state if state else ([], [])
        return whatif_markdown(steps, ar, choice, width, fraction)

    def export_tree(state, fmt):
        steps = state[0] if state else []
        return run_snippet([s.parents for s in steps], fmt) if steps else "# run a generation first"

    def compare(prompt, policy_a, policy_b, budget, temperature, seed, max_new_tokens):
        budget, seed, max_new_tokens = int(budget), int(seed), int(max_new_tokens)
        check_limits(prompt, budget, temperature, max_new_tokens)
        table = [
            "| policy | tokens | target forwards | tokens/forward | tokens/s decoding | speedup vs ar |",
            "|---|---|---|---|---|---|",
        ]
        texts = {}
        try:
            ar = speedup.ar_steps(pair, prompt, temperature, seed, max_new_tokens, ar_cache)
            for policy in ("ar", policy_a, policy_b):
                speedup.warm_up(pair, policy, budget, ar_cache)
                steps: list[StepVerified] = []
                r = dyspec.generate(
                    pair,
                    prompt,
                    policy=policy,
                    budget=budget,
                    temperature=temperature,
                    seed=seed,
                    max_new_tokens=max_new_tokens,
                    hooks=[lambda e, steps=steps: steps.append(e) if isinstance(e, StepVerified) else None],
                )
                texts[policy] = r.text
                table.append(
                    f"| {policy} | {r.new_tokens} | {r.target_forwards} | {r.tokens_per_forward:.2f} "
                    f"| {decode_rate(steps):.1f} | {measured_speedup(steps, ar)} |"
                )
                yield "\n".join(table), texts.get(policy_a, ""), texts.get(policy_b, "")
        except DyspecError as e:
            raise gr.Error(str(e)) from None

    with gr.Blocks(title="dyspec") as demo:
        gr.Markdown(
            f"# dyspec: speculative decoding with token trees\ntarget `{pair.target_name}` ({pair.precision}), "
            f"draft `{pair.drafts_label}`, {pair.device}; default: `{default_policy}` at budget {defaults.budget}, "
            "the fastest measured on this kind of device. Green tokens were drafted and accepted; blue ones are "
            "the target's own (bonus or correction)."
        )
        with gr.Tab("Generate"):
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0].prompt, lines=5, elem_id="prompt")
                    expect = gr.Textbox(
                        label="What to expect", value=EXAMPLES[0].expect, lines=2, interactive=False, elem_id="expect"
                    )
                    gr.Examples(
                        [[e.prompt, e.expect] for e in EXAMPLES],
                        [prompt, expect],
                        example_labels=[e.label for e in EXAMPLES],
                        label="Examples: where trees pay, and where they pay little",
                    )
                    policy = gr.Dropdown(
                        policies,
                        value=default_policy,
                        label="Policy",
                        info=f"{default_policy} at budget {defaults.budget} is the fastest measured on a "
                        f"{pair.device.type}; others may be slower than ar here (the speedup says)",
                    )
                    budget = gr.Slider(
                        1, LIMITS["budget"], value=defaults.budget, step=1, label="Budget (drafted tokens per step)"
                    )
                    temperature = gr.Slider(0, LIMITS["temperature"], value=0, step=0.05, label="Temperature")
                    seed = gr.Number(value=0, precision=0, label="Seed")
                    max_new = gr.Slider(1, LIMITS["max_new_tokens"], value=64, step=1, label="Max new tokens")
                    measure_ar = gr.Checkbox(value=True, label="Compare with ar on the same prompt (for speedup)")
                    with gr.Row():
                        run_btn = gr.Button("Run", variant="primary", elem_id="run")
                        stop_btn = gr.Button("Stop", elem_id="stop")
                with gr.Column(scale=2):
                    stats = gr.Markdown(elem_id="stats")
                    text = gr.HTML(elem_id="text")
                    tree = gr.Plot(label="Token tree", elem_id="tree")
                    step_slider = gr.Slider(0, 1, value=0, step=1, label="Step")
                    growth_slider = gr.Slider(1, 2, value=1, step=1, label="Growth (nodes shown, in growth order)")
                    with gr.Accordion("Export this run's tree to a serving engine", open=False):
                        with gr.Row():
                            fmt = gr.Dropdown(list(VIEW_FORMATS), value="trtllm", label="Format", elem_id="format")
                            export_btn = gr.Button("Export this tree", elem_id="export")
                        export_code = gr.Code(
                            language="python", label="Paste into your engine's config", elem_id="snippet"
                        )
                    chart = gr.Plot(label="Per step", elem_id="chart")
                    with gr.Accordion("Hardware what-if: this run's trees priced elsewhere", open=True):
                        gr.Markdown(
                            "Tokens per forward belong to the model pair and the text; the speedup is that times "
                            "the hardware's price of a tree. Priced with a latency profile (forwards only)."
                        )
                        with gr.Row():
                            choice = gr.Dropdown(choices, value=choices[0], label="Hardware", elem_id="hardware")
                            width = gr.Slider(1, 256, value=64, step=1, label="Parametric: t(n) flat up to width")
                            fraction = gr.Slider(0, 1, value=0.1, step=0.01, label="Parametric: draft / t(1)")
                        whatif_md = gr.Markdown("Run a generation to price its trees.", elem_id="whatif")
            state = gr.State(None)
            run_evt = run_btn.click(
                run,
                [prompt, policy, budget, temperature, seed, max_new, measure_ar, choice, width, fraction],
                [text, tree, chart, stats, state, step_slider, growth_slider, whatif_md],
                api_name="run",
                concurrency_limit=concurrency,
            )
            stop_btn.click(None, None, None, cancels=[run_evt])
            for slider in (step_slider, growth_slider):
                slider.release(show_step, [state, step_slider, growth_slider], [tree, growth_slider], api_name=False)
            export_btn.click(export_tree, [state, fmt], export_code, api_name="export")
            for control in (choice, width, fraction):
                control.change(reprice, [state, choice, width, fraction], whatif_md, api_name=False)
        with gr.Tab("Compare"):
            with gr.Row():
                c_prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0].prompt, lines=3)
                with gr.Column():
                    c_a = gr.Dropdown(policies, value="chain" if "chain" in policies else policies[0], label="Policy A")
                    c_b = gr.Dropdown(policies, value=default_policy, label="Policy B")
                    c_budget = gr.Slider(1, LIMITS["budget"], value=defaults.budget, step=1, label="Budget")
                    c_temp = gr.Slider(0, LIMITS["temperature"], value=0, step=0.05, label="Temperature")
                    c_seed = gr.Number(value=0, precision=0, label="Seed")
                    c_max = gr.Slider(1, LIMITS["max_new_tokens"], value=48, step=1, label="Max new tokens")
            c_btn = gr.Button("Compare with ar", variant="primary")
            c_table = gr.Markdown()
            with gr.Row():
                c_text_a = gr.Textbox(label="Policy A output", lines=6)
                c_text_b = gr.Textbox(label="Policy B output", lines=6)
            c_btn.click(
                compare,
                [c_prompt, c_a, c_b, c_budget, c_temp, c_seed, c_max],
                [c_table, c_text_a, c_text_b],
                api_name="compare",
                concurrency_limit=concurrency,
            )
    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    return demo


def main() -> None:
    parser = argparse.ArgumentParser(description="dyspec web app")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--device", default=None)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--concurrency", type=int, default=1, help="generations at once; others wait in the queue")
    parser.add_argument(
        "--whatif-profile",
        action="append",
        default=[],
        metavar="FILE",
        help="a latency profile from `dyspec profile --json` on other hardware, for the what-if menu (repeatable)",
    )
    args = parser.parse_args()
    try:
        profiles = {m.name: m for m in map(whatif.load_profile, args.whatif_profile)}
        pair = dyspec.load_pair(args.target, args.draft, args.device, precision=args.precision)
        print("warming up (one short generation per default policy)...", flush=True)
        demo = build_app(pair, args.concurrency, profiles)
    except DyspecError as e:
        parser.exit(2, f"app.py: error: {e}\n")
    demo.launch(server_name=args.host, server_port=args.port, show_error=True)


if __name__ == "__main__":
    main()
