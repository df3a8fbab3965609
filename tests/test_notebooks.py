"""Every tutorial notebook runs top to bottom on the offline default pair, and is stored without
outputs; its executed copy is left where the docs site's tutorials read it (docs/hooks.py)."""

import ast
import os
import re
import time
from pathlib import Path
from queue import Empty
from types import SimpleNamespace

import nbformat
import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from nbclient import NotebookClient
from traitlets import Type
from traitlets.config import Config

from dyspec.auto.profile import PROFILE_MARGIN

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / "build" / "notebooks"  # docs/hooks.py's
# figures as HTML beside plotly's own mimetype, plotly.js in the page: the docs site draws them offline
RENDERER = "plotly_mimetype+notebook"
POLL_SLICE_S = 1.0


class SlicedPollChannel(AsyncZMQSocketChannel):
    """Waits for a message in slices of POLL_SLICE_S, each ending in a plain check of the socket.
    pyzmq's asyncio poller can miss the wake-up for a message that has already arrived (zeromq/
    pyzmq#1558): the wait then ends only at its timeout, where that check finds the message. Seen
    here under two test workers: a kernel idle with its cell done (its `In` held the cell) while
    nbclient, idle in epoll, waited out its 600 s cell timeout; and, with 5 s slices, an
    execute_reply and a display_data that both arrived only at a slice's end."""

    async def get_msg(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, max(0.0, deadline - time.monotonic()))
            try:
                return await super().get_msg(left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class SlicedPollClient(AsyncKernelClient):
    shell_channel_class = Type(SlicedPollChannel)
    iopub_channel_class = Type(SlicedPollChannel)


def test_there_are_six_tutorials():
    assert len(NOTEBOOKS) == 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, request):
    book = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")
    NotebookClient(
        book,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.parent)}},
        config=Config({"KernelManager": {"client_factory": SlicedPollClient}}),
    ).execute(env=os.environ | {"PLOTLY_RENDERER": RENDERER})
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    EXECUTED.mkdir(parents=True, exist_ok=True)
    nbformat.write(book, EXECUTED / path.name)
    printed = "".join(o.get("text", "") for c in book.cells if c.cell_type == "code" for o in c.outputs)
    # an exercise's check says nothing of the answer before the learner acts
    before = {
        "01_quickstart": "write your guess first",
        "02_anatomy_of_a_dynamic_tree": "set TRY above",
        "03_policies_compared": "set BUDGET = 16 in the cell above",
        "04_tuning_budget_and_temperature": "set my_estimate above first",
        "05_bring_your_own_models": "list the drafts you tried",
        "06_exactness": "write your answer in my_answers first",
    }
    if path.stem in before:
        assert before[path.stem] in printed and not {"right", "close:"} & set(printed.split())
    if path.stem == "04_tuning_budget_and_temperature":  # it times the forward decoding runs, as the profile does
        here, profiled = map(float, re.search(r"t\(1\): ([\d.]+) ms measured here, ([\d.]+) ms", printed).groups())
        assert 1 / PROFILE_MARGIN <= here / profiled <= PROFILE_MARGIN, (here, profiled)
    if path.stem == "03_policies_compared":  # Sequoia checked against its own DP
        assert re.search(r"sequoia: [\d.]+ tokens per forward predicted by its DP, [\d.]+ measured", printed)
    if path.stem == "06_exactness":  # every policy the pair can run, each identical to ar
        from dyspec.policies import available_policies

        for policy in available_policies(request.getfixturevalue("default_pair")):
            assert f"{policy:18} identical to ar: True" in printed


def test_policies_notebooks_measure_passes_settings_and_its_expansion_example_fits():
    """03's `measure` hands temperature and a policy's options to every run (its exercises set them),
    runs ar beside the policy at the same temperature, and the expansion its exercise suggests fits
    the budget it names."""
    from dyspec.eval.speedup import measured_speedup
    from dyspec.policies.specinfer import parse_expansion

    book = nbformat.read(next(p for p in NOTEBOOKS if p.stem == "03_policies_compared"), as_version=4)
    source = next(c.source for c in book.cells if "def measure(" in c.source)
    functions = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    calls = []

    def steps_of(pair, prompt, **settings):
        calls.append(settings)
        step = SimpleNamespace(
            tokens=[0] * 9, emitted=[1, 2], draft_forwards=2, draft_s=0.1, target_s=0.2, overhead_s=0.0
        )
        return [step] if settings["policy"] != "ar" else [SimpleNamespace(**vars(step) | {"emitted": [1]})]

    space = {
        "dyspec": SimpleNamespace(generate=lambda pair, prompt, **settings: calls.append(settings)),
        "steps_of": steps_of,
        "measured_speedup": measured_speedup,
        "pair": None,
        "prompts": ["a"],
        "TOKENS": 4,
        "BUDGET": 4,
    }
    exec(compile(ast.Module(functions, []), "03", "exec"), space)
    m = space["measure"]("specinfer", 8, temperature=0.6, options={"expansion": "4,1"})
    assert (m["nodes"], m["draft_forwards"], m["tokens_per_forward"], m["speedup"].ratio) == (8, 2, 2, 2)
    policy_runs = [c for c in calls if c["policy"] == "specinfer"]
    assert len(policy_runs) == 2 and len(calls) == 4  # each warmed up, then one run per prompt
    assert all(c["options"] == {"expansion": "4,1"} and c["budget"] == 8 for c in policy_runs)
    assert all(c["temperature"] == 0.6 for c in calls)
    text = next(c.source for c in book.cells if "## Exercises" in c.source)
    (example,) = re.findall(r'measure\("specinfer", (\d+), options=\{"expansion": "([\d,]+)"\}\)', text)
    assert parse_expansion(example[1], int(example[0]))  # raises where the tree is over the budget
