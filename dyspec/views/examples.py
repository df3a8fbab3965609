"""Example prompts for the web app and the dashboard: where token trees pay, and where they pay
little, each with what to expect and why, as measured on the default pair
(docs/results/cpu-examples.md; tests/test_views.py holds the texts to that record). None comes from
a prompt set the bench measures on."""

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
        "Trees pay some: the draft knows the months and guesses them well, but the answer repeats nothing of "
        "the prompt, and copies from the prompt are what this machine's default gains most from.",
    ),
    Example(
        "Fix a passage",
        "Correct the spelling in this text and return it whole:\n\n"
        "Teh library opens at nine in the morning and closes at six in the evening. Visitors can borow "
        "up to five books at a time, and each book can be kept for two weeks. Late returns cost ten "
        "cents a day.",
        "Trees pay most: the answer repeats the passage, and text already in the prompt is what drafts and "
        "prompt lookup predict best, so long paths are accepted. A target this small hands the passage back "
        "with its typos: it copies rather than corrects, as it does without speculation.",
    ),
    Example(
        "Edit code",
        "Rename the variable x to total in this Python function and return the whole function:\n\n"
        "def add_all(items):\n    x = 0\n    for item in items:\n        x = x + item\n    return x",
        "Trees pay some on code: its lines reuse the prompt's names. A target this small rewrites the function "
        "wrongly instead of renaming the variable: whatever it writes is what it writes without speculation.",
    ),
    Example(
        "Arithmetic",
        "A shop sells pens at 3 dollars each. How much do 4 pens cost? Explain step by step.",
        "Trees pay some: step-by-step answers reuse the question's words. A target this small muddles the "
        'units ("4 pens = 12 pens"), exactly as it does without speculation.',
    ),
    Example(
        "A story",
        "Write a short story about a lighthouse keeper who finds a strange bottle on the beach.",
        "Trees pay some, for a reason of this target's own: a model this small loops, writing the same "
        "sentence again and again, and a repeat is what prompt lookup copies. A bigger target's story pays less.",
    ),
    Example(
        "An explanation",
        "Explain in one paragraph why the sky is blue.",
        "Trees pay least: free prose has many likely next words and repeats neither the prompt nor itself, so "
        "the draft's guesses are accepted least often.",
    ),
]
