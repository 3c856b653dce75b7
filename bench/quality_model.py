"""The quality test model: a Gemma 4 MoE trained on English text, big enough to rank quantization
algorithms, built once and cached.

    python bench/quality_model.py [--out DIR] [--force] [--steps N]

Builds into `bench/_work/quality-model/` by default (gitignored) and reuses a build made by the
same builder from the same inputs: `quality-model.json` in the folder records a hash of this file,
`convert/embedded_model.py` (whose building blocks it uses), the training and eval texts, the
settings and the torch / transformers / tokenizers versions; any change rebuilds. Prints the
held-out perplexity on `convert/data/eval_text.jsonl` and the build and training times.

What it builds (`Settings`, `QUALITY_ARCHITECTURE`):

* a byte-level BPE tokenizer (4096 ids) trained on `bench/data/train_text.jsonl`, Gemma 4's
  control tokens at their real ids and its chat template (`embedded_model.train_tokenizer`);
* a `Gemma4ForConditionalGeneration` with gemma-4-26B-A4B's structure (`embedded_model.model_config`):
  5 sliding-window layers (window 128 tokens, below the 512-token training and eval context)
  and 1 full-attention layer with `attention_k_eq_v` (no `v_proj`), 16 experts with top-4
  routing and the dense MLP beside them in every layer, the router's `per_expert_scale` (trained
  from 1), a tied `lm_head`, and each layer's `layer_scalar` trained from 0.7 (transformers
  initialises this buffer to 1 and never trains it, so a path that dropped it would go unseen).
  Every quantized linear's input dimension is a multiple of the NVFP4 block (16).
* trained deterministically in fp32 on the CPU (`embedded_model.deterministic_cpu`): next-token
  loss over 512-token windows of the training text plus the switch load-balancing loss; saved in
  bf16 with a release-format `config.json` (`embedded_model.save_model`).

The eval text is never trained on (the build refuses a training text that shares a document with
it); 6 of the training text's 66 documents are held back as a validation set, logged during
training. Perplexity is `exp(mean next-token NLL)` over every token of each document, in
windows of `ctx` tokens that each start with `<bos>` (no overlap; not scored), computed
teacher-forced with the whole saved model (bf16 weights, fp32 compute).

From Python: `from bench.quality_model import ensure_quality_model` (repo root on `sys.path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tokenizers
import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, Gemma4ForConditionalGeneration, PreTrainedTokenizerBase

from g4.convert import embedded_model as em
from g4.core.errors import G4Error

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
TRAIN_TEXT = ROOT / "bench" / "data" / "train_text.jsonl"
EVAL_TEXT = Path(em.__file__).resolve().parent / "data" / "eval_text.jsonl"
DEFAULT_OUT = ROOT / "bench" / "_work" / "quality-model"
STAMP = "quality-model.json"
VALIDATION_EVERY = 11  # training documents 10, 21, 32, ... are the validation set
LOG_VALIDATION_TOKENS = 4096  # scored by the validation PPL logged during training (all at the end)

# The per-model Gemma4TextConfig fields (embedded_model.model_config adds the shared structure).
QUALITY_ARCHITECTURE = {
    "hidden_size": 192,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "global_head_dim": 96,
    "num_global_key_value_heads": 1,
    "intermediate_size": 256,
    "num_experts": 16,
    "top_k_experts": 4,
    "moe_intermediate_size": 96,
    "sliding_window": 128,
}


@dataclass(frozen=True)
class Settings:
    """Everything a build depends on besides the code, the texts and the library versions.

    `steps` optimizer steps of `batch_size` windows of `ctx` tokens; AdamW at `peak_lr` with
    `warmup_steps` of warm-up and cosine decay (`embedded_model.make_optimizer`);
    `threads` intra-op threads (part of what makes the result repeat bit for bit; one thread
    because two on two shared cores ran 3-7x slower per step than one, each step waiting on
    the slower thread); `eval_tokens` caps the tokens scored in the validation and held-out
    passes (None: all).
    """

    steps: int = 400
    batch_size: int = 4
    ctx: int = 512
    vocab_size: int = 4096
    peak_lr: float = 3e-3
    warmup_steps: int = 40
    weight_decay: float = 0.05
    balance_loss_weight: float = 0.01
    layer_scalar_init: float = 0.7
    seed: int = 0
    threads: int = 1
    eval_tokens: int | None = None
    architecture: dict = field(default_factory=lambda: dict(QUALITY_ARCHITECTURE))


def read_documents(path: Path) -> list[str]:
    """The `text` field of every line of a `{"title": ..., "text": ...}` jsonl file."""
    return [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]


def input_hash(settings: Settings) -> str:
    """sha256 over the builder sources, both texts, `settings` and the library versions."""
    h = hashlib.sha256()
    for path in (Path(__file__).resolve(), Path(em.__file__).resolve(), TRAIN_TEXT, EVAL_TEXT):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__}
    h.update(json.dumps({"settings": dataclasses.asdict(settings), "versions": versions}, sort_keys=True).encode())
    return h.hexdigest()


def _token_ids(tokenizer: PreTrainedTokenizerBase, documents: list[str]) -> list[list[int]]:
    return [tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in documents]


def windows(documents: list[list[int]], ctx: int, max_tokens: int | None = None) -> list[list[int]]:
    """Each document cut into consecutive windows of `ctx - 1` tokens, each with `<bos>` in front
    (the last window of a document may be shorter); at most `max_tokens` scored tokens in all."""
    out, left = [], max_tokens
    for ids in documents:
        for start in range(0, len(ids), ctx - 1):
            piece = ids[start : start + ctx - 1]
            if left is not None:
                piece, left = piece[:left], left - len(piece[:left])
            if not piece:
                return out
            out.append([em.BOS_ID] + piece)
    return out


@torch.no_grad()
def perplexity(model: nn.Module, documents: list[list[int]], ctx: int, max_tokens: int | None = None) -> tuple[float, int]:
    """Teacher-forced perplexity of `model` over `windows(documents, ctx, max_tokens)`.

    Returns:
        `(exp(mean NLL), scored tokens)`; every token after the `<bos>` of a window is scored,
        the logits computed in the model's dtype and the NLL in fp32.
    """
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for window in windows(documents, ctx, max_tokens):
        ids = torch.tensor([window])
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll += nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    model.train(was_training)
    return math.exp(nll / count), count


def _trainable_layer_scalars(model: Gemma4ForConditionalGeneration, value: float) -> None:
    """Turn every decoder layer's `layer_scalar` buffer into a parameter set to `value`."""
    for layer in model.model.language_model.layers:
        del layer._buffers["layer_scalar"]
        layer.layer_scalar = nn.Parameter(torch.full((1,), value))


def _frozen_layer_scalars(model: Gemma4ForConditionalGeneration) -> None:
    """Back to persistent buffers (as transformers defines and saves them), trained values kept."""
    for layer in model.model.language_model.layers:
        value = layer._parameters.pop("layer_scalar").detach().clone()
        layer.register_buffer("layer_scalar", value, persistent=True)


def _capped(limit: int | None, cap: int) -> int:
    return cap if limit is None else min(limit, cap)


def _train(model: Gemma4ForConditionalGeneration, stream: list[int], validation: list[list[int]],
           settings: Settings) -> float:
    """Next-token training on random `ctx`-token windows of `stream` (each `<bos>` + `ctx - 1`
    tokens), plus `balance_loss_weight` x the switch balancing loss. Returns the last loss."""
    rng = random.Random(settings.seed)
    optimizer, schedule = em.make_optimizer(model, settings.steps, peak_lr=settings.peak_lr,
                                            warmup_steps=settings.warmup_steps, weight_decay=settings.weight_decay)
    top_k = model.config.get_text_config().top_k_experts
    span = settings.ctx - 1
    log_every = max(1, settings.steps // 5)
    model.train()
    start = time.monotonic()
    for step in range(settings.steps):
        starts = [rng.randrange(len(stream) - span) for _ in range(settings.batch_size)]
        ids = torch.tensor([[em.BOS_ID] + stream[s : s + span] for s in starts])
        out = model(input_ids=ids, output_router_logits=True)
        lm_loss = nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss = lm_loss + settings.balance_loss_weight * em.balance_loss(
            out.router_logits, torch.ones(ids.numel(), dtype=torch.bool), top_k)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == settings.steps - 1:
            val = perplexity(model, validation, settings.ctx, _capped(settings.eval_tokens, LOG_VALIDATION_TOKENS))[0]
            logger.info("step %d/%d loss %.4f (train PPL %.1f), validation PPL %.1f, %.2f s/step", step + 1,
                        settings.steps, loss.item(), math.exp(lm_loss.item()), val,
                        (time.monotonic() - start) / (step + 1))
    model.eval()
    return loss.item()


def _stored_parameters(path: Path) -> int:
    with safe_open(path, "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def build(out_dir: Path, settings: Settings = Settings()) -> dict:
    """Train the quality model from scratch into `out_dir` (which must not exist) and stamp it.

    Returns:
        The stamp written to `out_dir/quality-model.json`: `input_hash`, `settings`,
        `heldout_ppl` / `heldout_tokens` (on `EVAL_TEXT`), `validation_ppl`, `train_ppl_last`,
        `parameters` (stored, tied head once), `train_seconds`, `build_seconds`.

    Raises:
        G4Error: the training text shares a document with the eval text.
        RuntimeError: the tokenizer layout or the release-format config check fails.
    """
    begin = time.monotonic()
    train_docs, eval_docs = read_documents(TRAIN_TEXT), read_documents(EVAL_TEXT)
    shared = set(train_docs) & set(eval_docs)
    if shared:
        raise G4Error(f"{TRAIN_TEXT}: {len(shared)} document(s) also in the held-out eval text {EVAL_TEXT}")
    fit_docs = [d for i, d in enumerate(train_docs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    val_docs = [d for i, d in enumerate(train_docs) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    with em.deterministic_cpu(settings.threads):
        torch.manual_seed(settings.seed)
        tokenizer = em.train_tokenizer(fit_docs, settings.vocab_size)
        stream = [t for ids in _token_ids(tokenizer, fit_docs) for t in ids + [em.EOS_ID]]
        validation = _token_ids(tokenizer, val_docs)
        model = Gemma4ForConditionalGeneration(em.model_config(tokenizer, settings.architecture)).float()
        _trainable_layer_scalars(model, settings.layer_scalar_init)
        logger.info("%d training tokens, %d validation documents", len(stream), len(validation))
        start = time.monotonic()
        last_loss = _train(model, stream, validation, settings)
        train_seconds = time.monotonic() - start
        _frozen_layer_scalars(model)
        model.to(torch.bfloat16)
        em.save_model(model, tokenizer, out_dir)

        tokenizer = AutoTokenizer.from_pretrained(out_dir)
        em.check_release_config(model, out_dir, tokenizer(eval_docs[0][:2000], return_tensors="pt"))
        saved = Gemma4ForConditionalGeneration.from_pretrained(out_dir, dtype=torch.bfloat16).float()
        validation_ppl, _ = perplexity(saved, validation, settings.ctx, settings.eval_tokens)
        heldout_ppl, heldout_tokens = perplexity(saved, _token_ids(tokenizer, eval_docs), settings.ctx,
                                                 settings.eval_tokens)
    stamp = {
        "input_hash": input_hash(settings),
        "settings": dataclasses.asdict(settings),
        "heldout_text": EVAL_TEXT.name,
        "heldout_ppl": round(heldout_ppl, 3),
        "heldout_tokens": heldout_tokens,
        "validation_ppl": round(validation_ppl, 3),
        "train_loss_last": round(last_loss, 4),
        "train_tokens": len(stream),
        "parameters": _stored_parameters(out_dir / "model.safetensors"),
        "train_seconds": round(train_seconds, 1),
        "build_seconds": round(time.monotonic() - begin, 1),
    }
    (out_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def read_stamp(out_dir: Path) -> dict | None:
    """The stamp of a finished build in `out_dir`, or None."""
    try:
        return json.loads((Path(out_dir) / STAMP).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def ensure_quality_model(out_dir: Path = DEFAULT_OUT, settings: Settings = Settings(), *,
                         force: bool = False) -> tuple[Path, dict, bool]:
    """The quality model in `out_dir`, built unless a build from the same inputs is there.

    A new build goes to a temporary folder beside `out_dir` and replaces it only when complete.

    Returns:
        `(out_dir, stamp, built)`: `built` is False when the cached build was reused.

    Raises:
        G4Error: `out_dir` exists and is not a quality-model build (it is never deleted), or
            the training text overlaps the eval text.
    """
    out_dir = Path(out_dir)
    stamp = read_stamp(out_dir)
    if stamp is not None and not force and stamp.get("input_hash") == input_hash(settings):
        return out_dir, stamp, False
    if out_dir.exists() and stamp is None and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise G4Error(f"{out_dir}: exists and holds no {STAMP}; not replacing it (choose another --out)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        stamp = build(tmp / "model", settings)
        if out_dir.exists():  # a stamped build from other inputs
            out_dir.rename(tmp / "old")
        (tmp / "model").rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir, stamp, True


def main(argv: list[str] | None = None) -> int:
    """CLI; returns the exit status (2 with one `error:` line on a G4Error)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="build folder (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a matching build is cached")
    ap.add_argument("--steps", type=int, default=Settings.steps, help="optimizer steps (default: %(default)s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        out, stamp, built = ensure_quality_model(args.out, Settings(steps=args.steps), force=args.force)
    except G4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    arch = stamp["settings"]["architecture"]
    print(f"{out}: {'built' if built else 'cached build'}; {stamp['parameters']:,} parameters; "
          f"{arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, {arch['num_experts']} experts "
          f"top-{arch['top_k_experts']}, vocab {stamp['settings']['vocab_size']}")
    print(f"held-out PPL {stamp['heldout_ppl']:.2f} on {stamp['heldout_tokens']} tokens of {stamp['heldout_text']} "
          f"(uniform: {stamp['settings']['vocab_size']}); validation PPL {stamp['validation_ppl']:.2f}; "
          f"trained {stamp['settings']['steps']} steps in {stamp['train_seconds']:.1f} s, "
          f"build {stamp['build_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
