"""A batch's Ray round trip: roll's ``Batch`` pickling (CPU tensors as numpy arrays) against
torch's own tensor pickling, side by side in one Ray cluster.

Why it matters: every RL step sends the rollout batch to the inference and training workers and
back. On a small model those calls are a visible share of the step (``benchmarks/step_profile.py``):
torch pickles a tensor through its storage, about a millisecond per tensor here, while pickle
protocol 5 carries a numpy array as an out-of-band buffer. The payload is a batch as the
quickstart's training update receives it (256 samples, 13 tensors); each variant is sent to an actor
and back, alternating, median of ``--calls`` round trips after a warm-up.

    python benchmarks/bench_batch_transfer.py [--calls 50] [--samples 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class TorchPickled:
    """The same tensors, pickled by torch (what a plain dict of tensors gets)."""

    def __init__(self, tensors: dict, non_tensors: dict):
        self.tensors, self.non_tensors = tensors, non_tensors


def quickstart_batch(samples: int):
    from roll_core.data import Batch

    g = torch.Generator().manual_seed(0)
    ints = {k: torch.randint(0, 90, (samples, w), generator=g) for k, w in
            (("prompt_ids", 7), ("prompt_mask", 7), ("responses", 8), ("response_mask", 8))}
    floats = {k: torch.rand(samples, 8, generator=g) for k in
              ("advantages", "returns", "infer_log_probs", "token_rewards", "loss_mask")}
    rows = {k: torch.rand(samples, generator=g) for k in ("scores", "group_ids", "sample_mask", "response_length")}
    return Batch({**ints, **floats, **rows}, {"prompt": ["12+34="] * samples, "ground_truth": ["46"] * samples})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="error",
             _system_config={"worker_niceness": 0})

    @ray.remote(num_cpus=0)
    class Echo:
        def back(self, payload):
            return payload

    echo = Echo.remote()
    batch = quickstart_batch(args.samples)
    variants = {"torch pickling": TorchPickled(batch.tensors, batch.non_tensors), "roll Batch": batch}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.calls + 1):
        for name, payload in variants.items():
            start = time.perf_counter()
            back = ray.get(echo.back.remote(payload))
            times[name].append(time.perf_counter() - start)
            assert torch.equal(back.tensors["responses"], batch["responses"])
    base = statistics.median(times["torch pickling"][1:])
    print(f"{args.samples} samples, {len(batch.tensors)} tensors; median of {args.calls} round trips")
    for name in variants:
        ms = statistics.median(times[name][1:]) * 1e3
        print(f"{name:<16} {ms:7.2f} ms  {base * 1e3 / ms:5.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
