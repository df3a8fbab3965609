"""Example prompts for the web app and the dashboard: where token trees pay, and where they pay
little, each with what to expect and why. None comes from a prompt set the bench measures on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    label: str
    prompt: str
    expect: str


EXAMPLES = [
    Example(
        "Fix a passage",
        "Correct the spelling in this text and return it whole:\n\n"
        "Teh library opens at nine in the morning and closes at six in the evening. Visitors can borow "
        "up to five books at a time, and each book can be kept for two weeks. Late returns cost ten "
        "cents a day.",
        "Trees pay most: the answer repeats the passage, so the draft copies long runs and the target "
        "accepts several tokens per forward.",
    ),
    Example(
        "Edit code",
        "Rename the variable x to total in this Python function and return the whole function:\n\n"
        "def add_all(items):\n    x = 0\n    for item in items:\n        x = x + item\n    return x",
        "Trees pay well: most of the answer is the given code, copied token for token.",
    ),
    Example(
        "A list",
        "List the twelve months of the year, one per line.",
        "Trees pay: a familiar sequence that the draft predicts almost as well as the target.",
    ),
    Example(
        "Arithmetic",
        "A shop sells pens at 3 dollars each. How much do 4 pens cost? Explain step by step.",
        "Trees pay well: step-by-step working is predictable, and it repeats the question's words and numbers.",
    ),
    Example(
        "A story",
        "Write a short story about a lighthouse keeper who finds a strange bottle on the beach.",
        "Trees pay little: open-ended writing has many likely next words, and the draft's guesses are "
        "accepted less often.",
    ),
]
