"""dyspec web app: watch a token tree grow, get verified, and pay off against autoregressive decoding.

    python app.py [--host 127.0.0.1] [--port 7860] [--target ID] [--draft ID] [--device D]

The operator chooses the models when starting the app; a web user picks only among the built-in
policies, within limits (LIMITS), and never loads a path or remote code. Generations are queued:
at most `--concurrency` run at once (default 1: on a CPU, two at once only share the cores).
"""

from __future__ import annotations

import argparse

import gradio as gr

import dyspec
from dyspec import figures
from dyspec.errors import DyspecError
from dyspec.events import GenerationFinished, StepVerified
from dyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, PRECISIONS
from dyspec.policies import available_policies

LIMITS = {"max_new_tokens": 256, "budget": 64, "prompt_chars": 4000, "temperature": 2.0}
EXAMPLE = "Explain speculative decoding to a new engineer in one paragraph."


def check_limits(prompt: str, budget: int, temperature: float, max_new_tokens: int) -> None:
    if not prompt.strip():
        raise gr.Error("Type a prompt first.")
    if len(prompt) > LIMITS["prompt_chars"]:
        raise gr.Error(f"The prompt is limited to {LIMITS['prompt_chars']} characters here.")
    if not 1 <= budget <= LIMITS["budget"] or not 1 <= max_new_tokens <= LIMITS["max_new_tokens"]:
        raise gr.Error(f"Budget must be 1-{LIMITS['budget']} and max new tokens 1-{LIMITS['max_new_tokens']}.")
    if not 0 <= temperature <= LIMITS["temperature"]:
        raise gr.Error(f"Temperature must be between 0 and {LIMITS['temperature']}.")


def stats_markdown(steps: list[StepVerified], finished: GenerationFinished | None, ar_tps: float | None) -> str:
    tokens = sum(len(s.emitted) for s in steps)
    seconds = sum(s.draft_s + s.target_s + s.overhead_s for s in steps) or 1e-9
    lines = [
        f"**{tokens} tokens in {len(steps)} target forwards** "
        f"({tokens / max(len(steps), 1):.2f} per forward), {tokens / seconds:.1f} tokens/s while decoding"
    ]
    if ar_tps:
        lines.append(
            f"**speedup vs ar: {tokens / seconds / ar_tps:.2f}x** (ar measured on this prompt just before: "
            f"{ar_tps:.1f} tokens/s while decoding)"
        )
    if finished is not None:
        lines.append(f"done ({finished.stop_reason}): {finished.wall_s:.2f} s wall, prefill included")
    return "\n\n".join(lines)


def slider_update(last: int, first: int, value: int | None = None):
    """Move a slider's range to [first, last] (a slider needs first < last) and its value to `value`."""
    return gr.update(maximum=max(last, first + 1), value=last if value is None else value)


def build_app(pair: dyspec.ModelPair, concurrency: int = 1) -> gr.Blocks:
    policies = available_policies(pair)

    def run(prompt, policy, budget, temperature, seed, max_new_tokens, measure_ar):
        budget, seed, max_new_tokens = int(budget), int(seed), int(max_new_tokens)
        check_limits(prompt, budget, temperature, max_new_tokens)
        if policy not in policies:
            raise gr.Error(f"Unknown policy {policy!r}.")
        try:
            ar_tps = None
            if measure_ar and policy != "ar":
                ar = dyspec.generate(
                    pair, prompt, policy="ar", temperature=temperature, seed=seed, max_new_tokens=max_new_tokens
                )
                ar_tps = ar.decode_tokens_per_s
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
                        figures.steps_figure(steps, ar_tps),
                        stats_markdown(steps, finished, ar_tps),
                        steps,
                        slider_update(len(steps) - 1, 0),
                        slider_update(len(steps[-1].tokens), 1),
                    )
        except DyspecError as e:
            raise gr.Error(str(e)) from None

    def show_step(steps, index, growth):
        if not steps:
            return gr.skip(), gr.skip()
        step = steps[min(int(index), len(steps) - 1)]
        upto = min(int(growth), len(step.tokens))
        return figures.tree_figure(step, upto), slider_update(len(step.tokens), 1, upto)

    def compare(prompt, policy_a, policy_b, budget, temperature, seed, max_new_tokens):
        budget, seed, max_new_tokens = int(budget), int(seed), int(max_new_tokens)
        check_limits(prompt, budget, temperature, max_new_tokens)
        rows, texts = [], {}
        try:
            for policy in ("ar", policy_a, policy_b):
                r = dyspec.generate(
                    pair,
                    prompt,
                    policy=policy,
                    budget=budget,
                    temperature=temperature,
                    seed=seed,
                    max_new_tokens=max_new_tokens,
                )
                rows.append((policy, r))
                texts[policy] = r.text
                table = [
                    "| policy | tokens | target forwards | tokens/forward | tokens/s | speedup vs ar |",
                    "|---|---|---|---|---|---|",
                ]
                base = rows[0][1].decode_tokens_per_s
                for name, res in rows:
                    table.append(
                        f"| {name} | {res.new_tokens} | {res.target_forwards} | {res.tokens_per_forward:.2f} "
                        f"| {res.decode_tokens_per_s:.1f} | {res.decode_tokens_per_s / base:.2f}x |"
                    )
                yield "\n".join(table), texts.get(policy_a, ""), texts.get(policy_b, "")
        except DyspecError as e:
            raise gr.Error(str(e)) from None

    with gr.Blocks(title="dyspec") as demo:
        gr.Markdown(
            f"# dyspec: speculative decoding with token trees\ntarget `{pair.target_name}`, draft "
            f"`{pair.drafts_label}`, {pair.device} ({pair.precision}). Green tokens were drafted and "
            "accepted; blue ones are the target's own (bonus or correction)."
        )
        with gr.Tab("Generate"):
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(label="Prompt", value=EXAMPLE, lines=4, elem_id="prompt")
                    policy = gr.Dropdown(policies, value="dyspec" if "dyspec" in policies else "ar", label="Policy")
                    budget = gr.Slider(1, LIMITS["budget"], value=8, step=1, label="Budget (drafted tokens per step)")
                    temperature = gr.Slider(0, LIMITS["temperature"], value=0, step=0.05, label="Temperature")
                    seed = gr.Number(value=0, precision=0, label="Seed")
                    max_new = gr.Slider(1, LIMITS["max_new_tokens"], value=64, step=1, label="Max new tokens")
                    measure_ar = gr.Checkbox(value=True, label="Measure ar on the same prompt first (for speedup)")
                    with gr.Row():
                        run_btn = gr.Button("Run", variant="primary", elem_id="run")
                        stop_btn = gr.Button("Stop", elem_id="stop")
                with gr.Column(scale=2):
                    stats = gr.Markdown(elem_id="stats")
                    text = gr.HTML(elem_id="text")
                    tree = gr.Plot(label="Token tree", elem_id="tree")
                    step_slider = gr.Slider(0, 1, value=0, step=1, label="Step")
                    growth_slider = gr.Slider(1, 2, value=1, step=1, label="Growth (nodes shown, in growth order)")
                    chart = gr.Plot(label="Per step")
            steps_state = gr.State([])
            run_evt = run_btn.click(
                run,
                [prompt, policy, budget, temperature, seed, max_new, measure_ar],
                [text, tree, chart, stats, steps_state, step_slider, growth_slider],
                api_name="run",
                concurrency_limit=concurrency,
            )
            stop_btn.click(None, None, None, cancels=[run_evt])
            step_slider.release(
                show_step, [steps_state, step_slider, growth_slider], [tree, growth_slider], api_name=False
            )
            growth_slider.release(
                show_step, [steps_state, step_slider, growth_slider], [tree, growth_slider], api_name=False
            )
        with gr.Tab("Compare"):
            with gr.Row():
                c_prompt = gr.Textbox(label="Prompt", value=EXAMPLE, lines=3)
                with gr.Column():
                    c_a = gr.Dropdown(policies, value=policies[min(1, len(policies) - 1)], label="Policy A")
                    c_b = gr.Dropdown(
                        policies, value="dyspec" if "dyspec" in policies else policies[-1], label="Policy B"
                    )
                    c_budget = gr.Slider(1, LIMITS["budget"], value=8, step=1, label="Budget")
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
    args = parser.parse_args()
    try:
        pair = dyspec.load_pair(args.target, args.draft, args.device, precision=args.precision)
    except DyspecError as e:
        parser.exit(2, f"app.py: error: {e}\n")
    build_app(pair, args.concurrency).launch(server_name=args.host, server_port=args.port, show_error=True)


if __name__ == "__main__":
    main()
