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
        "A list",
        "List the twelve months of the year, one per line.",
        "Trees pay well: a familiar sequence that the draft predicts almost as well as the target, so deep "
        "paths are accepted.",
    ),
    Example(
        "Fix a passage",
        "Correct the spelling in this text and return it whole:\n\n"
        "Teh library opens at nine in the morning and closes at six in the evening. Visitors can borow "
        "up to five books at a time, and each book can be kept for two weeks. Late returns cost ten "
        "cents a day.",
        "Trees pay well: the answer reuses the passage, and text already in the prompt is what drafts (and "
        "prompt lookup) predict best, so long paths are accepted.",
    ),
    Example(
        "Edit code",
        "Rename the variable x to total in this Python function and return the whole function:\n\n"
        "def add_all(items):\n    x = 0\n    for item in items:\n        x = x + item\n    return x",
        "Trees pay well on code and predictable sentences. A target this small may rewrite the function its "
        "own way instead of renaming the variable: whatever it writes is what it writes without speculation.",
    ),
    Example(
        "Arithmetic",
        "A shop sells pens at 3 dollars each. How much do 4 pens cost? Explain step by step.",
        "Trees pay: step-by-step answers repeat their own phrases. Whatever this small target writes, right "
        "or wrong, is exactly what it writes without speculation.",
    ),
    Example(
        "A story",
        "Write a short story about a lighthouse keeper who finds a strange bottle on the beach.",
        "Trees pay least: open-ended writing has many likely next words, so the draft's guesses are accepted "
        "less often.",
    ),
]
