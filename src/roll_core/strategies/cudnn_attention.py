"""Whether PyTorch's attention may use cuDNN's kernel on a GPU: ``runtime.cudnn_attention``, off by default.

Why: on recent NVIDIA GPUs (an H200 here) ``scaled_dot_product_attention`` picks cuDNN's attention for
bfloat16 inputs, as a ``bf16`` role's forward passes are under autocast. cuDNN builds an execution
plan for every new shape of queries and keys, tens of milliseconds of CPU work each, and keeps it for
that shape only. An RL run rarely repeats a shape: every decoding step attends over one more key,
every batch has its own lengths. On the H200, with the plan built anew at each step, bf16 generation
of ``benchmarks/large_model.py``'s 95M model (64 samples, 64 new tokens) took 3.7-4.0 s against fp32's
0.9 s; a profile put 2.37 s of it in 64 calls that built plans (``aten::_cudnn_attention_forward``,
37 ms each), and ``benchmarks/vs_trl.py --device cuda --precision bf16`` measured roll's step at 0.21x
TRL's. With cuDNN's kernel off, PyTorch takes its flash or memory-efficient kernels, which need no
plan: on the same card bf16 generation took 0.68-1.16 s against 2.6-4.6 s with it on, and the RL
step 1.34x TRL's (``benchmarks/bench_cudnn_attention.py``, ``docs/benchmarks.md``). A run whose
shapes repeat (fixed-length batches) may gain from cuDNN's: set the option.

It is a process-wide switch of torch (``torch.backends.cuda.enable_cudnn_sdp``), set by every worker
as it starts (:func:`configure`, as ``runtime.cpu_matmul`` is); on the ``local`` executor that is the
driver's process. It changes nothing on a CPU, and nothing in engines with attention of their own
(vLLM, SGLang, Megatron's).
"""

from __future__ import annotations

import torch


def configure(enabled: bool) -> None:
    """Let this process's ``scaled_dot_product_attention`` use cuDNN's kernel, or not."""
    torch.backends.cuda.enable_cudnn_sdp(enabled)


def enabled() -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled()
