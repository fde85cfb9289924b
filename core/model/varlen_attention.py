"""Variable-length attention: PyTorch's flash kernel over a packed row, and a reference.

`torch.nn.attention.varlen.varlen_attn` attends over sequences laid end to end (queries
`[T, heads, dim]`, boundaries as cumulative lengths), so a packed row needs no padding, gathers
or scatters. Its signature has changed between releases (2.9: `is_causal`, no `scale`; 2.10 and
2.11: `window_size` and `scale`; later: `enable_gqa` too); `varlen_call` reads the installed
one once and passes what it takes. It runs on CUDA in bf16 or fp16 only.

`varlen_reference` computes the same thing with one SDPA call per sequence, in any dtype and on
any device: the oracle of the tests and of the GPU checks.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: The dtypes the flash kernel takes.
FLASH_DTYPES = (torch.bfloat16, torch.float16)

#: (-1, 0): causal, aligned to the last key (a query sees every key up to its own position
#: counted from the end), so a sequence whose keys are another's tokens then its own sees all
#: of that other sequence.
CAUSAL = (-1, 0)


def installed_kernel() -> Callable | None:
    """This PyTorch's `varlen_attn`, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _parameters(kernel: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def varlen_call(kernel: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
                scale: float | None) -> torch.Tensor:
    """Causal `kernel` attention (lower-right aligned), query `[Tq, heads, dim]`, key/value
    `[Tk, kv_heads, dim]` -> `[Tq, heads, dim]`, through whichever signature `kernel` has."""
    taken = _parameters(kernel)
    options: dict = {}
    if "window_size" in taken:
        options["window_size"] = CAUSAL
    else:  # 2.9: is_causal, which flash aligns to the last key as well
        options["is_causal"] = True
    if "enable_gqa" in taken:
        options["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    if scale is not None:
        if "scale" in taken:
            options["scale"] = scale
        else:  # the kernel scales by 1 / sqrt(dim)
            query = query * (scale * math.sqrt(query.shape[-1]))
    return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)


def varlen_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
                     *, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                     enable_gqa: bool = False) -> torch.Tensor:
    """What `varlen_attn` computes (full or lower-right causal attention per sequence), one
    SDPA call per sequence."""
    if window_size not in (CAUSAL, (-1, -1)):
        raise ValueError(f"window_size {window_size}: only full or causal attention")
    q_edges, k_edges = cu_seq_q.tolist(), cu_seq_k.tolist()
    outputs = []
    for q_start, q_end, k_start, k_end in zip(q_edges[:-1], q_edges[1:], k_edges[:-1],
                                              k_edges[1:]):
        queries, keys, values = (t.transpose(0, 1)[None] for t in (
            query[q_start:q_end], key[k_start:k_end], value[k_start:k_end]))
        mask = None
        if window_size == CAUSAL:
            n, seen = q_end - q_start, k_end - k_start
            mask = torch.ones(n, seen, dtype=torch.bool, device=query.device).tril(seen - n)
        if enable_gqa and keys.shape[1] != queries.shape[1]:
            groups = queries.shape[1] // keys.shape[1]
            keys, values = (t.repeat_interleave(groups, dim=1) for t in (keys, values))
        outputs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                      scale=scale)[0].transpose(0, 1))
    return torch.cat(outputs)
