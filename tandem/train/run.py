"""One `tandem train-draft` sitting: self-distillation data (missing shards only), training from
the last checkpoint, held-out evaluation, the head in the public format with a model card.

Run folder:
    run.json                  the configuration of the latest sitting
    checkpoints/              the newest checkpoint (weights, optimizer, step, loss history)
    head/                     the head in the public EAGLE / Medusa format, README.md, training.json
                              (Medusa: medusa_choices.json, its static tree fit on the held-out ranks)
    training.json             the same record: data, steps, losses, held-out metrics, sittings
    evaluation.json           `--eval-head DIR`: a head folder's metrics, with no training
Every sitting may end at --max-minutes; run the same command with --resume until training.json
says "status": "done".
"""

import json
import time
from pathlib import Path
from typing import Callable

import torch

from tandem.errors import InvalidArgument
from tandem.models.eagle_io import D2T_FILE
from tandem.models.medusa import CHOICES_FILE, write_head_choices
from tandem.train.config import TrainConfig
from tandem.train.dataset import ShardedData
from tandem.train.eagle_head import upgrade_one_layer_checkpoint
from tandem.train.loop import autocast, load_checkpoint, train
from tandem.train.acceptance import describe_chain, fitted_tree
from tandem.train.methods import DRAFT_METHODS
from tandem.train.mtbench_eval import describe_loops, evaluate_on_mtbench, evaluate_with_loops
from tandem.train.selfdistill import extra_training_shards, model_name, prepare_aux, prepare_data, shards_done, source_of

HEAD = "head"
Log = Callable[[str], None]


def run_train_draft(cfg: TrainConfig, home: Path | None, log: Log = print) -> dict:
    """Returns the record written to training.json; its "status" is "done", "time limit" or
    "data incomplete". Restores torch's thread count on return."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _sitting(cfg, home, log)
    finally:
        torch.set_num_threads(threads)


def evaluate_head(cfg: TrainConfig, home: Path | None, head_dir: Path, log: Log = print) -> dict:
    """Evaluates a head folder (a shipped head, another run's) with no training: on the held-out
    shard when the run's self-distilled data holds it, and on the first --eval-mtbench MT-bench
    questions (20 by default; none in --quick mode). Writes evaluation.json into the run folder and returns it."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        method = DRAFT_METHODS[cfg.method](cfg)
        module = method.load(Path(head_dir))
        evaluation = {"head": str(head_dir), "method": cfg.method}
        if Path(cfg.data_dir).is_dir() and 0 in shards_done(cfg.data_dir, cfg.data):
            if cfg.aux_layers:
                prepare_aux(cfg.data, [(cfg.data_dir, 0)], cfg.aux_layers, log=log)
            heldout = ShardedData(cfg.data_dir, [0], aux_layers=cfg.aux_layers)
            with autocast(getattr(torch, cfg.compute_dtype)):
                evaluation["heldout"] = evaluate_with_loops(method, module, heldout, cfg.batch_size)
            log(f"held-out: {describe_chain(evaluation['heldout'])}{describe_loops(evaluation['heldout'])}")
        if cfg.eval_mtbench:
            evaluation["mtbench"] = evaluate_on_mtbench(cfg, method, module, home, cfg.eval_mtbench, log)
    finally:
        torch.set_num_threads(threads)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "evaluation.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation


def _sitting(cfg: TrainConfig, home: Path | None, log: Log) -> dict:
    started = time.monotonic()
    deadline = started + cfg.max_minutes * 60 if cfg.max_minutes > 0 else None
    run_dir = Path(cfg.run_dir)
    saved = _saved_state(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    record = _previous_record(run_dir) if cfg.resume else {"sittings": []}
    sitting = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "step_from": saved["step"] if saved else 0}
    extra = [(d, k) for d in cfg.extra_data for k in extra_training_shards(d, cfg.data_dir, cfg.data)]
    stats = prepare_data(cfg.data, cfg.data_dir, home, deadline=deadline, log=log)
    sitting["data"] = {**stats, "shards": len(stats["shards"])}
    if not sitting["data"]["complete"]:
        return _finish(run_dir, cfg, record, sitting, started, status="data incomplete")
    if cfg.aux_layers:  # EAGLE-3's inputs: one more prefill of every answer, once
        parts = [(cfg.data_dir, k) for k in range(cfg.data.num_shards)] + extra
        prepare_aux(cfg.data, parts, cfg.aux_layers, log=log)
    heldout = ShardedData(cfg.data_dir, [0], aux_layers=cfg.aux_layers)
    data = ShardedData(cfg.data_dir, list(range(1, cfg.data.num_shards)), extra, cut_loops=cfg.cut_loops,
                       aux_layers=cfg.aux_layers)
    method = DRAFT_METHODS[cfg.method](cfg)
    module = _start_module(method, cfg, data, saved)
    result = train(method, module, data, cfg, saved=saved, deadline=deadline, log=log)
    sitting.update(step_to=result["step"], steps_per_s=round(result["steps_per_s"], 4),
                   sequences_per_s=round(result["steps_per_s"] * cfg.batch_size, 3))
    eval_started = time.monotonic()
    with autocast(getattr(torch, cfg.compute_dtype)):
        evaluation = evaluate_with_loops(method, module, heldout, cfg.batch_size)
    log(f"held-out: {describe_chain(evaluation)}{describe_loops(evaluation)}")
    if cfg.eval_mtbench:
        evaluation["mtbench"] = evaluate_on_mtbench(cfg, method, module, home, cfg.eval_mtbench, log)
    sitting["eval_seconds"] = round(time.monotonic() - eval_started, 1)
    method.save(module, run_dir / HEAD)
    if tree := fitted_tree(evaluation):
        write_head_choices(run_dir / HEAD, tree)
    d2t = getattr(module, "d2t", None)  # EAGLE's map: an --init-head run keeps the head's
    record.update(data_summary(cfg, data, heldout), steps=result["step"], history=result["history"],
                  evaluation=evaluation, draft_vocab=len(d2t) if d2t is not None else cfg.draft_vocab)
    if cfg.method == "eagle":
        record["draft_layers"] = len(getattr(module, "layers", (module,)))  # an EAGLE-3 head has one
    return _finish(run_dir, cfg, record, sitting, started, status=result["status"])


def _start_module(method, cfg: TrainConfig, data: ShardedData, saved: dict | None) -> torch.nn.Module:
    """A resumed run rebuilds from its checkpoint (weights and d2t map); a new one starts from
    --init-head's folder, or fresh."""
    if saved:
        upgrade_one_layer_checkpoint(saved)  # an EAGLE run checkpointed before heads had a layer list
        module = method.build(data, saved["model"])
        module.load_state_dict(saved["model"])
        return module
    return method.load(cfg.init_head) if cfg.init_head else method.build(data, None)


def _saved_state(cfg: TrainConfig, run_dir: Path) -> dict | None:
    saved = load_checkpoint(run_dir)
    if saved is not None and not cfg.resume:
        raise InvalidArgument(f"{run_dir} already holds a checkpoint (step {saved['step']}): "
                              "pass --resume to continue it, or another --out")
    if saved is None:
        return None
    previous = json.loads((run_dir / "run.json").read_text())
    if previous["method"] != cfg.method:
        raise InvalidArgument(f"{run_dir} holds a {previous['method']} run, not {cfg.method}")
    started_from = previous.get("init_head")
    if started_from != (str(cfg.init_head) if cfg.init_head else None):
        raise InvalidArgument(f"{run_dir} started from --init-head {started_from}; resume it with the same")
    if previous.get("cut_loops", False) != cfg.cut_loops:  # the data a run trains on stays what it was
        raise InvalidArgument(f"{run_dir} trained {'with' if previous.get('cut_loops') else 'without'} "
                              "--cut-loops; resume it the same way")
    if tuple(previous.get("aux_layers", ())) != cfg.aux_layers:
        raise InvalidArgument(f"{run_dir} trains {'an EAGLE-3' if previous.get('aux_layers') else 'an EAGLE-1/2'} "
                              f"head; resume it {'with' if previous.get('aux_layers') else 'without'} --eagle3")
    return saved


def _previous_record(run_dir: Path) -> dict:
    path = run_dir / "training.json"
    return json.loads(path.read_text()) if path.is_file() else {"sittings": []}


LOOPS_CUT = " (training answers that loop cut where they first repeat themselves, --cut-loops)"


def data_summary(cfg: TrainConfig, data: ShardedData, heldout: ShardedData) -> dict:
    extra = [{"dir": str(d), "source": source_of(json.loads((Path(d) / "meta.json").read_text())),
              "train_sequences": data.sequences_in(d)} for d in cfg.extra_data]
    identity = cfg.data.identity()
    return {"data": {"source": source_of(identity), "train_sequences": len(data),
                     "train_answer_tokens": data.answer_tokens, **({"extra": extra} if extra else {}),
                     "heldout_sequences": len(heldout), "heldout_answer_tokens": heldout.answer_tokens,
                     "answers": f"the target's own greedy answers ({identity.get('answers_dtype', cfg.data.target_dtype)}), up to "
                                f"{cfg.data.max_new_tokens} tokens{LOOPS_CUT if cfg.cut_loops else ''}; prompts "
                                f"chat-templated, up to {cfg.data.max_prompt_tokens} tokens"}}


def _finish(run_dir: Path, cfg: TrainConfig, record: dict, sitting: dict, started: float, *, status: str) -> dict:
    sitting.update(status=status, seconds=round(time.monotonic() - started, 1))
    record["sittings"] = [*record.get("sittings", []), sitting]
    record.update(status=status, method=cfg.method, target=str(cfg.head_target_dir), config=cfg.to_dict())
    text = json.dumps(record, indent=2) + "\n"
    (run_dir / "training.json").write_text(text)
    if (run_dir / HEAD).is_dir():
        (run_dir / HEAD / "training.json").write_text(text)
        (run_dir / HEAD / "README.md").write_text(model_card(cfg, record))
    return record


def _layers(count: int) -> str:
    return "one decoder layer" if count == 1 else f"{count} decoder layers"


def model_card(cfg: TrainConfig, record: dict) -> str:
    ev, data, last = record.get("evaluation", {}), record.get("data", {}), (record.get("history") or [{}])[-1]
    if cfg.aux_layers:
        arch = (f"EAGLE-3 head (fc over the inputs of target layers {list(cfg.aux_layers)}, one decoder layer over "
                f"[embed(t_{{i+1}}); feature], its own norm and lm_head), loss CE on the target's greedy token, "
                f"{cfg.ttt_steps} draft step(s) unrolled in training"
                f"{f', started from the head in {cfg.init_head}' if cfg.init_head else ''}")
        use = "tandem up --draft eagle --draft-model <this folder>"
    elif cfg.method == "eagle":
        token_loss = "KL from the target's distribution" if cfg.soft_labels else "CE on the target's greedy token"
        arch = (f"EAGLE-1 head (fc over [embed(t_{{i+1}}); f_i] + {_layers(record.get('draft_layers', 1))}; the target's embedding "
                f"and lm_head), loss SmoothL1(features) + {cfg.ce_weight} x {token_loss}, {cfg.ttt_steps} draft step(s) "
                f"unrolled in training{', first layer initialised from the target' if cfg.init_from_target else ''}"
                f"{f', started from the head in {cfg.init_head}' if cfg.init_head else ''}")
        use = "tandem up --draft eagle --draft-model <this folder>"
    else:
        arch = (f"Medusa-1: {cfg.medusa_heads} heads of {cfg.medusa_layers} residual block(s), "
                f"{cfg.medusa_lm_head} lm_head")
        use = "tandem up --draft medusa --draft-model <this folder>"
    if vocab := record.get("draft_vocab", cfg.draft_vocab):
        where = "its checkpoint's d2t" if cfg.aux_layers else f"{D2T_FILE} (EAGLE-3 d2t/t2d)"
        arch += f"; pruned draft vocabulary of {vocab} tokens in {where}"
    return f"""# {cfg.method} draft head for {model_name(cfg.head_target_dir)}

Trained by `tandem train-draft --method {cfg.method}` (self-distillation). Status: {record['status']}.

- Architecture: {arch}.
- Data: {data.get('source', '?')}{_extra_line(data)}; {data.get('train_sequences', 0)} training sequences
  ({data.get('train_answer_tokens', 0)} answer tokens); {data.get('answers', '')}.
- Training: {record.get('steps', 0)} of {cfg.steps} AdamW steps, {cfg.batch_size} sequences per step, lr {cfg.lr}
  ({cfg.schedule}, warm-up {cfg.warmup_steps}), {cfg.compute_dtype} matmuls; last logged loss {last.get('loss', '?')}.
- Held-out ({data.get('heldout_sequences', 0)} sequences, {ev.get('anchors', 0)} anchors; teacher-forced on the
  target's greedy answers, tokens per verify step with the target's own included):
  {describe_chain(ev) if "walk_histograms" in ev else "not evaluated"}.{_mtbench_line(ev)}

Use: `{use}`.{_tree_line(ev)} Details: training.json.
"""


def _extra_line(data: dict) -> str:
    extra = data.get("extra", [])
    return "".join(f"; and {e['train_sequences']} sequences of {e['source']} ({e['dir']})" for e in extra)


def _tree_line(ev: dict) -> str:
    tree = fitted_tree(ev)
    if tree is None:
        return ""
    return (f" It verifies `{CHOICES_FILE}`, the {len(tree)}-node static tree fit above on half the held-out "
            f"sequences, listed best first: `--tree-node-budget N` keeps its first N nodes.")


def _mtbench_line(ev: dict) -> str:
    parts = [f"{dtype} target: {describe_chain(m)}" for dtype, m in ev.get("mtbench", {}).items()]
    if not parts:
        return ""
    questions = next(iter(ev["mtbench"].values()))["questions"]
    return f"\n- On the target's own greedy answers to the first {questions} MT-bench questions: " + "; ".join(parts) + "."
