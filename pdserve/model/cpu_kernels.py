"""A paged decode-attention kernel for CPU that reads K/V blocks in place.

Pure torch has no attention that walks a block table: the fallback in
:func:`pdserve.model.layers.paged_attention` copies every decode group's blocks into a
contiguous buffer before SDPA, so each layer reads the cache twice and writes it once; decode
attention is memory-bound, so that copy costs as much as the attention itself
(docs/benchmarks.md, "Engine profile (issue 14)"). This module holds a small C kernel, compiled
once per machine with the system C compiler (``cc``, about a second) into
``$PDSERVE_CACHE/kernels`` (default ``~/.cache/pdserve/kernels``) and called through ``ctypes``.
It uses OpenMP from the same ``libgomp`` torch has loaded (one thread pool, torch's thread count).

No compiler, a failed build, or ``PDSERVE_CPU_KERNELS=0``: :func:`paged_decode_kernel` returns
``None`` and attention runs the torch path (same results up to float rounding).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

# One task per (decode row, KV head): the `g` query heads of that KV head read each key and value
# once. Two passes over the row's blocks (scores, then the weighted sum of values) with an exact
# softmax in between, like the reference attention (no running rescale).
_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

void paged_decode_f32(const float *q, int64_t q_row, int64_t q_head,
                      const float *kv, int64_t kv_heads, int64_t num_blocks, int64_t bs,
                      int64_t hd, const int64_t *table, int64_t table_row,
                      const int64_t *ctx, int64_t window, int64_t n, int64_t heads,
                      float scale, float *out) {
    const int64_t g = heads / kv_heads;
    const int64_t head_stride = num_blocks * bs * hd;       /* one KV head of K (or V) */
    const int64_t v_offset = kv_heads * head_stride;        /* V after K */
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * kv_heads; task++) {
        const int64_t i = task / kv_heads, h = task % kv_heads;
        const int64_t len = ctx[i];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t keys = len - first;
        if (keys <= 0) continue;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(g * keys));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(g * hd));
        const int64_t *blocks = table + i * table_row;
        const float *kh = kv + h * head_stride, *vh = kv + v_offset + h * head_stride;
        const float *qh = q + i * q_row + h * g * q_head;
        /* scores, one run of consecutive keys inside one block at a time, four keys per
           step (independent sums: a lone dot product waits on its own additions) */
        for (int64_t j = 0; j < keys;) {
            const int64_t p = first + j;
            int64_t run = bs - p % bs;
            if (run > keys - j) run = keys - j;
            const float *k = kh + (blocks[p / bs] * bs + p % bs) * hd;
            for (int64_t r = 0; r < g; r++) {
                const float *qr = qh + r * q_head;
                float *sr = scores + r * keys + j;
                int64_t t = 0;
                for (; t + 4 <= run; t += 4) {
                    const float *k0 = k + t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                    #pragma omp simd reduction(+:s0, s1, s2, s3)
                    for (int64_t d = 0; d < hd; d++) {
                        s0 += qr[d] * k0[d];
                        s1 += qr[d] * k1[d];
                        s2 += qr[d] * k2[d];
                        s3 += qr[d] * k3[d];
                    }
                    sr[t] = s0 * scale; sr[t + 1] = s1 * scale;
                    sr[t + 2] = s2 * scale; sr[t + 3] = s3 * scale;
                }
                for (; t < run; t++) {
                    const float *k0 = k + t * hd;
                    float s0 = 0.f;
                    #pragma omp simd reduction(+:s0)
                    for (int64_t d = 0; d < hd; d++) s0 += qr[d] * k0[d];
                    sr[t] = s0 * scale;
                }
            }
            j += run;
        }
        for (int64_t r = 0; r < g; r++) {
            float *sr = scores + r * keys;
            float m = -INFINITY, sum = 0.f;
            for (int64_t j = 0; j < keys; j++) m = sr[j] > m ? sr[j] : m;
            for (int64_t j = 0; j < keys; j++) { sr[j] = expf(sr[j] - m); sum += sr[j]; }
            const float inv = 1.f / sum;
            for (int64_t j = 0; j < keys; j++) sr[j] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)(g * hd));
        for (int64_t j = 0; j < keys; j++) {
            const int64_t p = first + j;
            const float *v = vh + (blocks[p / bs] * bs + p % bs) * hd;
            for (int64_t r = 0; r < g; r++) {
                const float w = scores[r * keys + j];
                float *a = acc + r * hd;
                #pragma omp simd
                for (int64_t d = 0; d < hd; d++) a[d] += w * v[d];
            }
        }
        for (int64_t r = 0; r < g; r++)
            memcpy(out + (i * heads + h * g + r) * hd, acc + r * hd, sizeof(float) * hd);
        free(scores);
        free(acc);
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def _cache_dir() -> str:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "pdserve")
    return os.path.join(root, "kernels")


def _build(path: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        src = os.path.join(tmp, "paged_decode.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        so = os.path.join(tmp, "paged_decode.so")
        subprocess.run([cc, *_FLAGS, src, "-o", so], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(so, path)  # atomic: concurrent builders each write a whole file


def _load() -> Any:
    """The compiled library, built on first use (``None`` when it cannot be)."""
    if "lib" in _loaded:  # every decode layer calls this: no lock once it is settled
        return _loaded["lib"]
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        if os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0":
            key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, platform.machine(),
                                            platform.node()]).encode()).hexdigest()[:16]
            path = os.path.join(_cache_dir(), f"paged_decode_{key}.so")
            try:
                if not os.path.isfile(path):
                    _build(path)
                # torch has loaded its libgomp.so.1: the kernel's OpenMP resolves to it
                lib = ctypes.CDLL(path)
                fn = lib.paged_decode_f32
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64,
                               i64, ctypes.c_float, ptr]
                fn.restype = None
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or ""
                log.warning("CPU paged-attention kernel unavailable (%s %s); using the torch "
                            "path", e, detail.strip()[:500])
                lib = None
        _loaded["lib"] = lib
        return lib


def available() -> bool:
    """Whether the kernel is (or can be) built and loaded here."""
    return _load() is not None


def paged_decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
                        ctx: torch.Tensor, scale: float, window: int | None = None
                        ) -> torch.Tensor | None:
    """Attention of one query token per row over its paged context, or ``None`` when the kernel
    does not apply (not CPU float32, not built).

    ``q``: ``[n, heads, hd]`` (last dim contiguous); ``kv_cache``: one layer,
    ``[2, kv_heads, blocks, block_size, hd]`` contiguous; ``table``: int64 ``[n, >= blocks
    needed]``; ``ctx``: int64 ``[n]``, keys ``[max(0, ctx - window), ctx)`` are visible.
    Returns ``[n, heads, hd]``.
    """
    if (q.device.type != "cpu" or q.dtype != torch.float32 or kv_cache.dtype != torch.float32
            or not kv_cache.is_contiguous() or q.stride(-1) != 1):
        return None
    lib = _load()
    if lib is None:
        return None
    n, heads, hd = q.shape
    _, kv_heads, num_blocks, bs, _ = kv_cache.shape
    table = table.contiguous()
    ctx = ctx.contiguous()
    out = q.new_empty(n, heads, hd)
    lib.paged_decode_f32(q.data_ptr(), q.stride(0), q.stride(1), kv_cache.data_ptr(), kv_heads,
                         num_blocks, bs, hd, table.data_ptr(), table.stride(0), ctx.data_ptr(),
                         int(window or 0), n, heads, float(scale), out.data_ptr())
    return out
