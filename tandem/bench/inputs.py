"""What a benchmark runs on: the model folder and the chat-templated prompts."""

from pathlib import Path

REDUCED_PROMPTS = 4  # --reduced: at most this many tiny prompts


def bench_model(args) -> Path:
    """--reduced: a tiny random model in a fresh temporary folder; else --model or the default."""
    if args.reduced:
        import tempfile

        from tandem.testing.tiny import build_tiny_model

        return build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    if args.model:
        return Path(args.model)
    from tandem.models.fetch import fetch_default_model, tandem_home

    return fetch_default_model(tandem_home())[args.dtype]


def bench_prompts(args, tokenizer) -> list[list[int]]:
    """Token ids of the first --questions prompts of the workload (MT-bench first turns, or
    --workload code: tandem/bench/code_workload.py; --reduced: tiny prompts), each as one user
    turn of the model's chat template, ending in the assistant's turn."""
    if args.reduced:
        from tandem.testing.tiny import TINY_PROMPTS

        texts = list(TINY_PROMPTS[: min(REDUCED_PROMPTS, args.questions)])
    elif getattr(args, "workload", "mtbench") == "code":
        from tandem.bench.code_workload import code_prompts

        texts = code_prompts()[: args.questions]
    else:
        from tandem.bench.data import mtbench_first_turns
        from tandem.models.fetch import tandem_home

        texts = mtbench_first_turns(tandem_home())[: args.questions]
    chats = [[{"role": "user", "content": t}] for t in texts]
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]
