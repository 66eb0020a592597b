"""The issue's own yardstick for a head: teacher-forced acceptance on the target's greedy
answers to MT-bench first turns (the questions `tandem bench` serves), next to the ShareGPT
held-out shard. A gap between the two is domain shift, not a serving fault; evaluating on
features from the fp32 target as well shows what serving an fp32 target costs a head trained
on bf16 features. A small target's greedy answers fall into loops, which any head drafts: the
answers that loop are counted and the head measured without them too.

The answers and features are made once per (questions, answer cap, dtype) into the run folder:
    mtbench-<dtype>-q<questions>-a<max_new_tokens>/   a one-shard data folder (shard 0)
"""

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.loops import LOOP_RULE, loops
from tandem.train.config import TrainConfig
from tandem.train.dataset import ShardedData, eval_batches
from tandem.train.loop import autocast
from tandem.train.acceptance import describe_chain
from tandem.train.selfdistill import answers_path, features_path, make_answers, make_features, prepare_aux, shards_done


def mtbench_data(cfg: TrainConfig, home: Path, questions: int, dtype: str, log) -> Path:
    """The one-shard data folder of the target's answers to the first `questions` questions (and
    the inputs of an EAGLE-3 run's aux layers)."""
    spec = replace(cfg.data, target_dtype=dtype, num_prompts=0, shard_prompts=questions,
                   target_dir=_target_dir(cfg, dtype), answers_from=None)  # its own answers
    out = Path(cfg.run_dir) / f"mtbench-{dtype}-q{questions}-a{spec.max_new_tokens}"
    if shards_done(out, spec) != [0]:
        _make_answers_and_features(spec, home, out, questions, dtype, log)
    if cfg.aux_layers:
        prepare_aux(spec, [(out, 0)], cfg.aux_layers, log=log)
    return out


def _make_answers_and_features(spec, home: Path, out: Path, questions: int, dtype: str, log) -> None:
    from tandem.bench.data import mtbench_first_turns

    prompts = mtbench_first_turns(home)[:questions]
    tokenizer = AutoTokenizer.from_pretrained(spec.target_dir)
    model = AutoModelForCausalLM.from_pretrained(spec.target_dir, dtype=getattr(torch, dtype)).eval()
    log(f"MT-bench: the target's ({dtype}) answers to {questions} questions")
    if not answers_path(out, 0).is_file():
        make_answers(model, tokenizer, spec, prompts, 0, out)
    if not features_path(out, 0).is_file():
        make_features(model, spec, 0, out)


def evaluate_with_loops(method, module, data: ShardedData, batch_size: int) -> dict:
    """The method's metrics over every answer, the number of answers that loop, and the metrics
    over the others (`without_loops`, when some loop and some do not: a second pass over them)."""
    clean = [i for i in range(len(data)) if not loops(data.answer_of(i).tolist())]
    metrics = method.evaluate(module, eval_batches(data, batch_size))
    metrics["answers"], metrics["looping_answers"] = len(data), len(data) - len(clean)
    if 0 < len(clean) < len(data):
        metrics["without_loops"] = {"answers": len(clean), **method.evaluate(module, eval_batches(data, batch_size, clean))}
    return metrics


def describe_loops(metrics: dict) -> str:
    looping = metrics["looping_answers"]
    if not looping:
        return "; no answer loops"
    text = f"; {looping} answer{'s' if looping > 1 else ''} of {metrics['answers']} loop ({LOOP_RULE})"
    if (clean := metrics.get("without_loops")) is None:
        return text
    trees = clean["walk_tree_accepted_length"]
    return (f"{text}, without them ({clean['answers']}): walk chains of {clean['chain_length']} / top-2 / top-3 trees "
            f"{clean['walk_accepted_length']:.3f} / {trees['top2']:.3f} / {trees['top3']:.3f}, top-1 {clean['heldout_top1']:.3f}")


def _target_dir(cfg: TrainConfig, dtype: str) -> Path:
    """The sibling folder of the other dtype (…/float32 next to …/bfloat16) when there is one."""
    target = Path(cfg.data.target_dir)
    sibling = target.parent / dtype
    return sibling if target.name in ("float32", "bfloat16") and (sibling / "config.json").is_file() else target


def evaluate_on_mtbench(cfg: TrainConfig, method, module, home: Path, questions: int, log) -> dict:
    """{dtype: chain metrics} on the target's answers to MT-bench, with the training dtype's
    features and, when it differs, the fp32 target's (what a served fp32 target streams)."""
    out = {}
    for dtype in dict.fromkeys([cfg.data.target_dtype, "float32"]):
        data = ShardedData(mtbench_data(cfg, home, questions, dtype, log), [0], aux_layers=cfg.aux_layers)
        with autocast(getattr(torch, cfg.compute_dtype)):
            metrics = evaluate_with_loops(method, module, data, cfg.batch_size)
        out[dtype] = {"questions": questions, **metrics}
        log(f"MT-bench ({dtype} target): {describe_chain(metrics)}{describe_loops(metrics)}")
    return out
