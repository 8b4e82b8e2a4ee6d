"""How long an optimizer step of the real base model takes on this machine, at a few batch
shapes, and a fit that gives the time of a step of any shape.

Jobs train through the offload engine (worker.training.engines.OffloadTrainEngine) under the
job's memory budget; so does this timed run: the same recipe, the same engine options (the
frozen base weights read from the model's files for LoRA), one step of random tokens at each
shape (what a step costs does not depend on which tokens). A first step warms the engine up
(thread pools, the page pool, the allocator) and is not counted.

The fit: seconds = fixed + seconds_per_flop * flops(rows, width), where flops counts the
step's matmuls from the model's shape: per token, `linear` for the weight matmuls (forward
and backward: 6 per weight for full fine-tuning, 4 for LoRA, whose frozen weights get no
gradient) and `attention` per token of width (12 * layers * hidden: the scores and the
weighted sum, forward and backward). Two numbers fitted to three timed shapes by least
squares of the relative error (neither negative; a job's steps are mostly short, 4 x 60-150
tokens, so the 4x256 point must not outweigh them) stay sensible when a measurement is
noisy, and the attention term carries the fit to widths longer than those timed.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from worker.training.flops import head_flops, matmul_flops, step_flops

log = logging.getLogger(__name__)

# (rows, width) timed per method: the default batch of 4 at three widths up to the default
# max_seq_len. Short widths dominate a job of practice questions; full chunks fill 256.
SHAPES = ((4, 64), (4, 128), (4, 256))
# A method whose warm-up step takes longer than this is timed at its smallest shape only:
# the worker should not spend many minutes measuring before it can train.
SLOW_STEP_S = 60.0
REPEATS = 2  # timed steps per shape; the fastest is kept
DISAGREE = 0.25  # two tries further apart than this (relative): a third, and the middle one


def fit_step_time(measured: list[tuple[int, int, float]],
                  flops: tuple[float, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per FLOP) fitted to (rows, width, seconds) measurements by
    least squares of the relative error: sum(((fixed + slope * x - y) / y) ** 2) smallest."""
    xs = [step_flops(flops, r, w) for r, w, _ in measured]
    ys = [s for _, _, s in measured]
    if len(xs) >= 2 and all(y > 0 for y in ys):
        # Weighted least squares, weights 1 / y**2.
        ws = [1.0 / (y * y) for y in ys]
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
        my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
        sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
        slope = sxy / sxx if sxx else 0.0
        fixed = my - slope * mx
        if slope > 0 and fixed >= 0:
            return fixed, slope
    # One point, or a fit with a negative part: all of the time scales with the work.
    return 0.0, sum(ys) / sum(xs)


def _synchronizer(device: torch.device | None):
    """What waits for `device`'s queued work before a clock is read (nothing on the CPU)."""
    if device is not None and device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def steady_seconds(step, repeats: int = REPEATS) -> float:
    """Seconds of `step()` as a job's steady steps take it: the fastest of `repeats` tries,
    or the middle of three when the first two disagree by more than DISAGREE."""
    tries = []
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        step()
        tries.append(time.perf_counter() - started)
    if len(tries) == 2 and max(tries) > (1 + DISAGREE) * min(tries):
        started = time.perf_counter()
        step()
        tries.append(time.perf_counter() - started)
        return sorted(tries)[1]
    return min(tries)


def time_method(
    model_dir: str,
    method: str,
    budget_bytes: int,
    swap_dir: Path,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    seed: int = 0,
    device: torch.device | None = None,
) -> tuple[list[tuple[int, int, float]], tuple[float, float], float, float]:
    """(rows, width, seconds of one optimizer step) for `method` at each of `shapes`, run as a
    job runs it (steady_seconds) on `device` (None: the CPU; "cuda": the model's resident
    part on the GPU, the engine's page pool in host memory, as a job there), the model's
    matmul FLOPs per token (matmul_flops), the output layer's share of them (head_flops),
    and the seconds of writing one checkpoint."""
    from transformers import AutoModelForCausalLM

    from worker.training.batches import pad_batch
    from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig
    from worker.training.resources import auto_budget_bytes

    cuda = device is not None and device.type == "cuda"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    # Before the engine takes the weights over.
    flops, head = matmul_flops(model, method), head_flops(model, method)
    if cuda:
        model = model.to(device)
    gen = torch.Generator().manual_seed(seed)

    def batch(rows: int, width: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, width), generator=gen).tolist()
        return pad_batch([{"input_ids": r, "labels": r} for r in ids], 0, width)

    widest = max(w for _, w in shapes)
    examples = [{"input_ids": [0] * widest, "labels": [0] * widest}]
    config = TrainConfig(method=method, epochs=1, max_seq_len=widest, learning_rate=1e-4)
    folder = Path(model_dir)
    Path(swap_dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="step-timing-", dir=swap_dir))
    engine = EngineOptions(
        budget_bytes=budget_bytes,
        swap_dir=workdir / "swap",
        weights_files=sorted(folder.glob("*.safetensors")) if folder.is_dir() else [],
        device=str(device) if cuda else None,
        host_budget_bytes=auto_budget_bytes(device=torch.device("cpu")) if cuda else None,
    )
    recipe = FineTuneRecipe(model, examples, config, workdir, engine=engine)
    sync = _synchronizer(device)

    def step(b: dict[str, torch.Tensor]) -> None:
        recipe.engine.step(b)
        sync()  # the GPU's queued kernels belong to the step's time

    measured: list[tuple[int, int, float]] = []
    checkpoint_s = 0.0
    try:
        recipe.setup()
        first = sorted(shapes, key=lambda s: s[0] * s[1])
        started = time.perf_counter()
        step(batch(*first[0]))  # warm-up, not counted
        slow = time.perf_counter() - started > SLOW_STEP_S
        for rows, width in first[:1] if slow else first:
            b = batch(rows, width)
            seconds = steady_seconds(lambda b=b: step(b), 1 if slow else REPEATS)
            measured.append((rows, width, seconds))
        started = time.perf_counter()
        recipe.save_checkpoint()
        checkpoint_s = time.perf_counter() - started
    finally:
        recipe.cleanup(remove_checkpoint=True, restore=False)
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("%s steps: %s; a checkpoint %.2f s", method,
             ", ".join(f"{r}x{w} {s:.2f} s" for r, w, s in measured), checkpoint_s)
    return measured, flops, head, checkpoint_s


def time_steps(model_dir: str, budget_bytes: int, swap_dir: Path,
               methods: tuple[str, ...] = ("lora", "full"),
               device: torch.device | None = None) -> dict[str, dict]:
    """The timed run and its fit for each method, as app.contract.machine_profile.StepFit."""
    out = {}
    for method in methods:
        measured, flops, head, checkpoint_s = time_method(
            model_dir, method, budget_bytes, swap_dir, device=device
        )
        fixed, per_flop = fit_step_time(measured, flops)
        out[method] = {"measured": [list(m) for m in measured], "fixed_s": fixed,
                       "s_per_flop": per_flop, "flops_per_token": list(flops),
                       "head_flops": head, "checkpoint_s": checkpoint_s}
    return out


# Scoring (worker/scoring/evaluate.py) generates answers in batches of 8 and reads held-out
# text in forwards of up to 8 x 256 tokens; timed once at those shapes.
SCORING_BATCH = 8
SCORING_PROMPT = 48  # tokens: a probe's text before its fact, or a question in chat
SCORING_NEW_TOKENS = 24


@torch.no_grad()
def time_scoring(model_dir: str, seed: int = 0, device: torch.device | None = None) -> dict:
    """Seconds per generated token of a batch of SCORING_BATCH prompts (its prefill
    included), and per forward of SCORING_BATCH x 256 tokens, for a model in memory on
    `device` (None: the CPU)."""
    from transformers import AutoModelForCausalLM

    from worker.training.resources import configure_threads

    device = device or torch.device("cpu")
    sync = _synchronizer(device)
    configure_threads()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (SCORING_BATCH, SCORING_PROMPT), generator=gen)
    prompts = prompts.to(device)
    mask = torch.ones_like(prompts)

    def decode() -> float:
        started = time.perf_counter()
        model.generate(input_ids=prompts, attention_mask=mask, do_sample=False,
                       max_new_tokens=SCORING_NEW_TOKENS, min_new_tokens=SCORING_NEW_TOKENS,
                       pad_token_id=0)
        sync()
        return (time.perf_counter() - started) / SCORING_NEW_TOKENS

    decode()  # warm-up
    decode_s = decode()
    text = torch.randint(0, vocab, (SCORING_BATCH, 256), generator=gen).to(device)
    model(input_ids=text)  # warm-up
    sync()
    started = time.perf_counter()
    model(input_ids=text)
    sync()
    forward_s = time.perf_counter() - started
    log.info("scoring: %.3f s per generated token (batch %d), %.2f s per forward of %dx256",
             decode_s, SCORING_BATCH, forward_s, SCORING_BATCH)
    return {"decode_s": decode_s, "forward_s": forward_s}


def general_forwards() -> int:
    """The forwards the forgetting check takes (its sample's paragraphs, SCORING_BATCH each)."""
    from worker.scoring.evaluate import general_chunks

    return -(-len(general_chunks()) // SCORING_BATCH)
