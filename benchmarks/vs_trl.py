"""roll against TRL's GRPOTrainer on identical work, side by side in one invocation.

Both libraries train the same model from the same checkpoint on the same prompts with the same
settings (the quickstart's: ``--prompts`` prompts x 8 samples per step, lr 3e-4 constant, clip
0.2, no KL, token-mean loss over the batch, group-normalised advantages, temperature 1, grad-norm
clip 1, AdamW with torch's default settings on its fused kernel, one forward-backward pass over the step's samples), for each seed, alternating libraries so drift of the
machine hits both alike. Each run is its own process; this script samples the memory of its whole
process tree (for roll on Ray: the driver, Ray's daemons and every worker), resident (RSS) and
proportional (PSS: a page that several processes map, as torch's libraries, counted once in all).

Two sizes:

* ``tiny``: the quickstart's embedded model (0.5M parameters), warmed up once by roll's own
  supervised warm-up (``warmup.steps``, seed 42), then ``--steps`` RL steps of 8 new tokens, with
  held-out accuracy every ``--eval-every`` steps (greedy, exact match, the same ``--eval-size`` rows;
  evaluation time is excluded from both);
* ``large``: the embedded architecture at about 95M parameters (hidden 768, 10 layers, random
  weights), ``--large-steps`` steps of ``--large-tokens`` new tokens: compute dominates and only
  speed is compared.

Printed per seed and as mean (min-max) over seeds, roll / TRL as ratios (above 1: roll better):
seconds per RL step (median of the steps between the first and the last), generated tokens per second, trained
tokens per second (prompt + response tokens of the batch per step second), peak memory (RSS and PSS), and for
``tiny`` the held-out accuracy curve and the time (sum of step seconds) each library needs to reach
TRL's final accuracy. To measure that time rather than cut it off, roll's tiny run goes on for
``--extra-steps`` steps past ``--steps`` (evaluated alike): a seed where roll gets there only after
step ``--steps`` counts with the time it took, one where it never does counts 0. Everything else
(seconds per step, tokens per second, the curves side by side) compares the first ``--steps`` steps. TRL is a benchmark-only dependency (``pip install -e ".[bench]"``). Run
nothing else CPU-heavy beside it.

    python benchmarks/vs_trl.py --size tiny --seeds 42 1 2          # ~10 min on 2 cores
    python benchmarks/vs_trl.py --size large --seeds 42 1 2         # ~22 min
    python benchmarks/vs_trl.py --size tiny --executor local        # roll's in-process executor
    python benchmarks/vs_trl.py --size tiny --load 1                # a core taken by another job
    python benchmarks/vs_trl.py --size large --compile              # torch.compile on both sides
    python benchmarks/vs_trl.py --size large --precision bf16       # bfloat16 autocast on both sides
    python benchmarks/vs_trl.py --executor local --device cuda      # both on one GPU (no Ray there)

``--compile`` compiles on both sides, each the way its library offers: roll's decoder layers
(``roles.actor_train.compile``), TRL's whole model (``torch_compile``, through the Trainer). The
first step, which compiles, is left out of seconds per step as always. ``--precision bf16`` runs
both in bfloat16 mixed precision the same way: forward passes under ``torch.autocast`` over float32
weights, for generation and training (roll's ``strategy_options.precision`` of its policy and its
sampler; TRL's ``bf16=True``, through accelerate). ``--device cuda`` trains and generates on the
first GPU on both sides (``cpu``, the default, hides the GPUs from both); the peak of the GPU's used
memory, less what was in use before the run, is printed beside the host's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead
from scratch import runs_dir  # the runs' directory: --keep, or removed at exit

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_PROMPT = 8


# -- the TRL side (runs in a child process: python vs_trl.py --trl-worker SPEC.json) --------------
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Held-out accuracy as roll measures it: greedy decoding, exact match after stripping."""
    import torch

    from roll_core.rewards import ExactMatch, RewardInput

    reward, hits = ExactMatch(), 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), 128):
            chunk = rows[i:i + 128]
            enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, padding_side="left",
                            add_special_tokens=False)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            hits += sum(reward.score(RewardInput(r["prompt"], t, r["ground_truth"])) for r, t in zip(chunk, texts))
    model.train()
    return hits / max(len(rows), 1)


def trl_worker(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roll_core.rewards import ExactMatch, RewardInput

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in spec["train_rows"]])
    exact = ExactMatch()

    def exact_match(prompts, completions, ground_truth, **_):
        return [exact.score(RewardInput(p, c, g)) for p, c, g in zip(prompts, completions, ground_truth)]

    samples = spec["prompts"] * SAMPLES_PER_PROMPT
    args = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"], seed=spec["seed"], use_cpu=spec["device"] == "cpu", bf16=spec["precision"] == "bf16",
        per_device_train_batch_size=samples, num_generations=SAMPLES_PER_PROMPT, generation_batch_size=samples,
        gradient_accumulation_steps=1, max_completion_length=spec["max_new_tokens"], learning_rate=3e-4,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, max_grad_norm=1.0, optim="adamw_torch_fused",
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
        dataloader_num_workers=0, disable_tqdm=True, torch_compile=spec["compile"])
    records: list[dict] = []

    class Clock(TrainerCallback):
        """Step seconds between consecutive step ends, minus the evaluations run in between."""

        def __init__(self):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            row = {"step": state.global_step, "step_s": now - self.last}
            if spec["eval_every"] and state.global_step % spec["eval_every"] == 0:
                row["accuracy"] = greedy_accuracy(kwargs["model"], tokenizer, spec["eval_rows"], spec["max_new_tokens"])
            records.append(row)
            self.last = time.perf_counter()  # evaluation time is not step time

        def on_log(self, args, state, control, logs=None, **kwargs):
            if records and logs and "completions/mean_length" in logs:
                records[-1]["response_length"] = logs["completions/mean_length"]

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Clock()])
    start = greedy_accuracy(model, tokenizer, spec["eval_rows"], spec["max_new_tokens"]) if spec["eval_every"] else None
    trainer.train()
    Path(spec["out"], "trl.json").write_text(json.dumps({"records": records, "start_accuracy": start}))


# -- the driver --------------------------------------------------------------------------------------
class GpuMemory:
    """Memory in use on the first GPU, less what was in use when this was made (NVML, which counts a
    process's CUDA context and its allocator's cache: what the run takes from the card)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.base = self.used()

    def used(self) -> int:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(self.handle).used

    def __call__(self) -> int:
        return max(0, self.used() - self.base)


class PeakMemory:
    """The largest summed memory of a process and all its descendants, sampled every 0.2 s: resident
    set (RSS, which counts a page every process maps, such as torch's libraries, once per process)
    and proportional set (PSS, which splits each shared page among the processes that map it: what
    the process tree takes from the machine). PSS costs the kernel a walk of the page tables (50-70 ms
    for a 5 GB process, a third of a core at this rate), so it is read only when the RSS sum passes
    its highest yet by 1%: at the peak, and rarely once a run has reached it. With ``gpu`` (a
    :class:`GpuMemory`), the GPU's peak too."""

    def __init__(self, pid: int, gpu: GpuMemory | None = None):
        import psutil

        self.root, self.peak, self.done = psutil.Process(pid), {"rss": 0, "pss": 0}, threading.Event()
        self.gpu = gpu
        if gpu:
            self.peak["gpu"] = 0
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        import psutil

        last_pss_at = 0
        while not self.done.is_set():
            if self.gpu:
                self.peak["gpu"] = max(self.peak["gpu"], self.gpu())
            try:
                procs = [p for p in [self.root, *self.root.children(recursive=True)] if p.is_running()]
                rss = sum(p.memory_info().rss for p in procs)
                self.peak["rss"] = max(self.peak["rss"], rss)
                if rss > 1.01 * last_pss_at:
                    self.peak["pss"] = max(self.peak["pss"], sum(p.memory_full_info().pss for p in procs))
                    last_pss_at = rss
            except psutil.Error:
                pass
            self.done.wait(0.2)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        return self.peak


class BackgroundLoad:
    """``n`` processes that each keep one core busy (a pure-Python loop at normal priority) while a
    measured run goes on: another job sharing the machine, the same for both libraries."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()


def device_env(device: str) -> dict[str, str]:
    """A child's environment: roll's code ahead on PYTHONPATH and, for ``cpu``, no GPU in sight (roll
    computes on a GPU whenever torch sees one)."""
    return child_env(ROOT / "src", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))


def run_measured(cmd: list[str], log: Path, device: str, load: int = 0) -> dict[str, int]:
    gpu = GpuMemory() if device == "cuda" else None
    with open(log, "w") as out, BackgroundLoad(load):
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=device_env(device))
        memory = PeakMemory(proc.pid, gpu)
        try:
            code = proc.wait()
        finally:  # interrupted: the run goes too, before its directory does
            if proc.poll() is None:
                proc.kill()
    peak = memory.stop()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({code}); the end of {log}:\n{log.read_text()[-3000:]}")
    return peak


def roll_cmd(model: str, out: Path, seed: int, steps: int, args, max_new_tokens: int, eval_every: int) -> list[str]:
    return [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={out}", f"model.path={model}", f"seed={seed}",
            "warmup.steps=0", f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}", "trainer.save_every=0",
            "trainer.resume=never", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.num_return_sequences={SAMPLES_PER_PROMPT}", f"rollout.max_new_tokens={max_new_tokens}",
            f"data.eval_size={args.eval_size}", f"executor={args.executor}", "trackers=[jsonl]",
            # one forward-backward pass over the step's samples, as trl_worker sets TRL's per_device_train_batch_size
            f"roles.actor_train.micro_batch_size={args.prompts * SAMPLES_PER_PROMPT}",
            f"torch_threads={args.threads}", f"roles.actor_train.compile={str(args.compile).lower()}",
            f"roles.actor_train.strategy_options.precision={args.precision}",
            f"roles.actor_infer.strategy_options.precision={args.precision}", *args.overrides]


def roll_result(out: Path) -> dict:
    """roll's steps and evaluations, all of them (the tiny run's ``--extra-steps`` included)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r]
    # wall time from one step's end to the next one's, logging included and evaluation left out:
    # what the TRL side's clock measures (between consecutive on_step_end calls, minus evaluation)
    return {"step_s": [r["time/iteration_s"] for r in steps],
            "response_length": [r["response_length/mean"] for r in steps],
            "accuracy": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}}


def trl_result(out: Path) -> dict:
    data = json.loads((out / "trl.json").read_text())
    records = data["records"]
    accuracy = {r["step"]: r["accuracy"] for r in records if "accuracy" in r}
    if data["start_accuracy"] is not None:
        accuracy[0] = data["start_accuracy"]
    return {"step_s": [r["step_s"] for r in records], "accuracy": dict(sorted(accuracy.items())),
            "response_length": [r.get("response_length", float("nan")) for r in records]}


def time_to(result: dict, target: float) -> float:
    """Seconds of steps until the first evaluation at or above ``target`` (inf: never)."""
    cumulative = [0.0]
    for s in result["step_s"]:
        cumulative.append(cumulative[-1] + s)
    for step, acc in sorted(result["accuracy"].items()):
        if acc >= target - 1e-9:
            return cumulative[min(step, len(cumulative) - 1)]
    return float("inf")


def first_steps(result: dict, steps: int) -> dict:
    """``result`` cut to its first ``steps`` steps and the evaluations up to there."""
    return {"step_s": result["step_s"][:steps], "response_length": result["response_length"][:steps],
            "accuracy": {k: v for k, v in result["accuracy"].items() if k <= steps}}


def summarize(result: dict, samples: int, prompt_tokens: float) -> dict:
    # The first and last steps are left out on both sides: roll's hybrid engine generates the next
    # step's samples in the same worker task as an update, so its first step generates twice (its
    # own and the next) and its last step not at all; the first step also compiles under --compile.
    inner = slice(1, -1) if len(result["step_s"]) >= 3 else slice(1, None)
    step_s = statistics.median(result["step_s"][inner] or result["step_s"])
    response = statistics.fmean(x for x in result["response_length"][inner] or result["response_length"] if x == x)
    return {"step_s": step_s, "gen_tok_s": samples * response / step_s,
            "train_tok_s": samples * (prompt_tokens + response) / step_s, "response_length": response}


def build_inputs(args, tmp: Path) -> dict:
    """The checkpoints both libraries start from, and the rows."""
    from transformers import AutoTokenizer

    from roll_core.config import load_config
    from roll_core.plugins import get_plugins
    from roll_core.pipelines.sources import load_rows

    models = {}
    if "tiny" in args.sizes:
        warm = tmp / "warm"
        print(f"warming up the tiny model once (roll's supervised warm-up, {args.warmup_steps} steps) ...", flush=True)
        subprocess.run([sys.executable, "-m", "roll_core.cli", "run", f"output_dir={warm}", "executor=local",
                        f"warmup.steps={args.warmup_steps}", "trainer.max_steps=0", "trainer.eval_every=0",
                        "trackers=[jsonl]", "trainer.resume=never"], check=True, capture_output=True,
                       env=device_env(args.device))
        models["tiny"] = str(warm / "warm-model")
    if "large" in args.sizes:
        from large_model import build_large_model

        models["large"] = str(build_large_model(tmp))
    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))
    train, evals = load_rows(load_config(None, [f"data.eval_size={args.eval_size}"]).data, get_plugins(), tokenizer)
    prompt_tokens = statistics.fmean(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in train)
    return {"models": models, "train": train, "eval": evals, "prompt_tokens": prompt_tokens}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def parameters(model: str) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())


def ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (both reached the target at once) and a / 0 = inf."""
    if b == 0:
        return 1.0 if a == 0 else float("inf")
    return a / b


def spread(values: list[float]) -> str:
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return "n/a"
    return f"{statistics.fmean(finite):.2f}x ({min(finite):.2f}-{max(finite):.2f})"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", dest="sizes", choices=["tiny", "large", "both"], default="both")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    ap.add_argument("--steps", type=int, default=200, help="RL steps at the tiny size")
    ap.add_argument("--extra-steps", type=int, default=200,
                    help="tiny: steps roll trains on past --steps, for its time to TRL's final accuracy")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-size", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (x8 samples)")
    ap.add_argument("--warmup-steps", type=int, default=500)
    ap.add_argument("--large-steps", type=int, default=5)
    ap.add_argument("--large-tokens", type=int, default=64)
    ap.add_argument("--large-prompts", type=int, default=8)
    ap.add_argument("--executor", default="ray", choices=["ray", "local"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each side")
    ap.add_argument("--load", type=int, default=0,
                    help="busy processes (one core each) running beside every measured run: a shared machine")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile on both sides: roll's roles.actor_train.compile, TRL's torch_compile")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: bfloat16 autocast on both sides (roll's strategy_options.precision, TRL's bf16)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both sides compute: the CPU (GPUs hidden) or the first GPU")
    ap.add_argument("--keep", type=Path, help="keep the runs' directories here")
    ap.add_argument("overrides", nargs="*", help="extra roll config overrides")
    args = ap.parse_args()
    args.sizes = ["tiny", "large"] if args.sizes == "both" else [args.sizes]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no GPU on this machine")
        if args.executor == "ray":
            print("note: --device cuda with Ray: roll's workers get the GPU only through roles.<role>.device_mapping "
                  "overrides; the local executor computes on it as is", flush=True)

    tmp = runs_dir(args.keep, "roll-vs-trl-")
    inputs = build_inputs(args, tmp)
    for size in args.sizes:
        model = inputs["models"][size]
        tiny = size == "tiny"
        steps, tokens = (args.steps, 8) if tiny else (args.large_steps, args.large_tokens)
        prompts = args.prompts if tiny else args.large_prompts
        eval_every = args.eval_every if tiny else 0
        samples = prompts * SAMPLES_PER_PROMPT
        print(f"\n== {size}: {parameters(model) / 1e6:.1f}M parameters, {prompts} prompts x {SAMPLES_PER_PROMPT} "
              f"samples, {tokens} new tokens, {steps} steps, roll on the {args.executor} executor, "
              f"{args.threads} torch threads each{', compiled' if args.compile else ''}, {args.precision}, "
              f"on the {gpu_name() if args.device == 'cuda' else 'CPU'}"
              f"{f', {args.load} busy process(es) beside each run' if args.load else ''} ==", flush=True)
        per_seed = []
        for seed in args.seeds:
            out_roll, out_trl = tmp / f"{size}-roll-{seed}", tmp / f"{size}-trl-{seed}"
            out_trl.mkdir(parents=True, exist_ok=True)
            spec = {"model": model, "out": str(out_trl), "seed": seed, "steps": steps, "prompts": prompts,
                    "max_new_tokens": tokens, "eval_every": eval_every, "threads": args.threads, "compile": args.compile,
                    "precision": args.precision, "device": args.device,
                    "train_rows": inputs["train"], "eval_rows": inputs["eval"] if eval_every else []}
            (out_trl / "spec.json").write_text(json.dumps(spec))
            # roll evaluates once before RL whatever eval_every says: keep that short where nothing is compared
            roll_args = argparse.Namespace(**{**vars(args), "prompts": prompts,
                                              "eval_size": args.eval_size if eval_every else 8})
            t0 = time.perf_counter()
            mem_trl = run_measured([sys.executable, __file__, "--trl-worker", str(out_trl / "spec.json")],
                                   tmp / f"{size}-trl-{seed}.log", args.device, args.load)
            t1 = time.perf_counter()
            roll_steps = steps + (args.extra_steps if eval_every else 0)
            mem_roll = run_measured(roll_cmd(model, out_roll, seed, roll_steps, roll_args, tokens, eval_every),
                                    tmp / f"{size}-roll-{seed}.log", args.device, args.load)
            t2 = time.perf_counter()
            whole, t = roll_result(out_roll), trl_result(out_trl)
            r = first_steps(whole, steps)
            rs, ts = (summarize(x, samples, inputs["prompt_tokens"]) for x in (r, t))
            row = {"seed": seed, "roll": rs, "trl": ts, "mem": (mem_roll, mem_trl), "wall": (t2 - t1, t1 - t0)}
            line = (f"seed {seed}: s/step roll {rs['step_s']:.3f} TRL {ts['step_s']:.3f} -> {ts['step_s'] / rs['step_s']:.2f}x; "
                    f"gen tok/s {rs['gen_tok_s']:.0f} vs {ts['gen_tok_s']:.0f}; train tok/s {rs['train_tok_s']:.0f} vs "
                    f"{ts['train_tok_s']:.0f}; peak memory {mem_roll['rss'] / 2**20:.0f} vs {mem_trl['rss'] / 2**20:.0f} MiB "
                    f"(PSS {mem_roll['pss'] / 2**20:.0f} vs {mem_trl['pss'] / 2**20:.0f}"
                    + (f", GPU {mem_roll['gpu'] / 2**20:.0f} vs {mem_trl['gpu'] / 2**20:.0f}" if "gpu" in mem_roll else "")
                    + "); "
                    f"wall {t2 - t1:.0f} s ({roll_steps} steps) vs {t1 - t0:.0f} s ({steps})")
            if eval_every:
                target = t["accuracy"][max(t["accuracy"])]
                row["time_to"] = (time_to(whole, target), time_to(t, target))
                later = {k: v for k, v in whole["accuracy"].items() if k > steps}
                row["curves"] = (r["accuracy"], t["accuracy"])
                line += (f"\n  held-out accuracy roll {' '.join(f'{a:.1%}' for a in r['accuracy'].values())}"
                         f"\n                    TRL  {' '.join(f'{a:.1%}' for a in t['accuracy'].values())}"
                         + (f"\n  roll's {args.extra_steps} steps more {' '.join(f'{a:.1%}' for a in later.values())}"
                            if later else "")
                         + f"\n  time to TRL's final {target:.1%}: roll {row['time_to'][0]:.1f} s, TRL {row['time_to'][1]:.1f} s")
            print(line, flush=True)
            per_seed.append(row)
        print(f"-- {size}, over seeds {args.seeds} (roll better above 1x; mean (min-max)):")
        print(f"   seconds per step      {spread([x['trl']['step_s'] / x['roll']['step_s'] for x in per_seed])}")
        print(f"   generated tokens/s    {spread([x['roll']['gen_tok_s'] / x['trl']['gen_tok_s'] for x in per_seed])}")
        print(f"   trained tokens/s      {spread([x['roll']['train_tok_s'] / x['trl']['train_tok_s'] for x in per_seed])}")
        for key in [k for k in ("rss", "pss", "gpu") if k in per_seed[0]["mem"][0]]:
            print(f"   peak memory ({key.upper()})    {spread([x['mem'][1][key] / x['mem'][0][key] for x in per_seed])}"
                  " (TRL / roll)")
        if eval_every:
            finals = [[curve[max(curve)] for curve in x["curves"]] for x in per_seed]  # at step --steps
            print(f"   accuracy at step {steps}  roll {statistics.fmean(f[0] for f in finals):.1%}, "
                  f"TRL {statistics.fmean(f[1] for f in finals):.1%} (mean over seeds)")
            print(f"   time to TRL's final accuracy {spread([ratio(x['time_to'][1], x['time_to'][0]) for x in per_seed])}")
        (tmp / f"{size}-summary.json").write_text(json.dumps(per_seed, indent=1, default=str))
    if args.keep:
        print(f"\nruns kept in {tmp}")


if __name__ == "__main__":
    main()
