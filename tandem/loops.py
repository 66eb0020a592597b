"""Loops in generated text: a small model's greedy decode often falls into repeating a sentence
or a list item over and over, which any draft predicts. Acceptance figures over such text say
more about the loops than about a draft, so the evaluation and the bench report them apart."""

from collections.abc import Sequence

NGRAM = 8  # tokens: a repeated 8-gram is a copied phrase, rarely a coincidence
LOOP_SHARE = 0.3  # a text loops when over this share of its 8-grams repeat an earlier one
LOOP_RULE = f"over {LOOP_SHARE:.0%} of its {NGRAM}-grams repeat an earlier one"


def repeated_ngram_share(tokens: Sequence[int], n: int = NGRAM) -> float:
    """The share of a text's n-grams that already occurred earlier in it: a few hundredths for
    prose, most of them in a loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def loops(tokens: Sequence[int]) -> bool:
    return repeated_ngram_share(tokens) > LOOP_SHARE


def loop_start(tokens: Sequence[int], n: int = NGRAM) -> int:
    """Where a text first repeats itself: the start of its first n-gram that occurred earlier in
    it (its length when none does). In a text that loops this is where the loop begins, or a
    phrase repeated before it: on the second-turn answers, cutting at the first run of 8 repeated
    8-grams instead would keep 4% more of the answer tokens."""
    seen = set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if gram in seen:
            return i
        seen.add(gram)
    return len(tokens)
