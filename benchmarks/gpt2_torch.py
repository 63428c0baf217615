"""The anchor of benchmarks/compare.py: the same GPT-2 124M training step in PyTorch with torch.compile.

    python benchmarks/gpt2_torch.py --dtype bfloat16 --batch 8 [--seq 1024 --steps 20] [--compile-only]

nanoGPT's model and step, matching examples/gpt2: pre-LayerNorm blocks, GELU (tanh), learned position
embeddings, the LM head tied to the token embedding, vocabulary padded to 50304 (--unpadded-vocab:
50257), attention through `F.scaled_dot_product_attention(is_causal=True)` (its fused kernels), AdamW
(fused; b2 0.95, weight decay 0.1 on matrices) after clipping the gradients' global norm to 1.0, and
`--dtype bfloat16` as nanoGPT runs it: `torch.autocast` to bf16 with f32 parameters and optimizer
state; float32 runs TF32 matmuls. PyTorch is the benchmark's reference only, never jnova's dependency.

Prints `RESULT {json}` (tok_s, ms, peak_gb, compile_s, mfu): compile_s is the first call (torch.compile
compiles lazily), peak_gb is torch.cuda.max_memory_allocated. Exits 2 without PyTorch or a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

PEAK_TFLOPS = {"NVIDIA H200": {"float32": 494.7e12, "bfloat16": 989.4e12},
               "NVIDIA H100 80GB HBM3": {"float32": 494.7e12, "bfloat16": 989.4e12}}


def build(torch, vocab: int, n_layer=12, n_head=12, d_model=768, block=1024):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.c_attn, self.attn_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.c_fc, self.mlp_proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(block, d_model)
            self.h = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d_model)
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, std=0.01 if name == "wpe.weight" else std)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()   # tied LM head
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    return GPT()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--unpadded-vocab", action="store_true")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--compile-only", action="store_true", help="the first (compiling) call only")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("PyTorch sees no GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    vocab = 50257 if args.unpadded_vocab else 50304
    model = build(torch, vocab, n_layer=args.n_layer).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, 50257, (args.batch, args.seq + 1), device="cuda")
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step():
        with autocast:
            loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    if args.compile_only:
        print("RESULT " + json.dumps({"compile_s": compile_s}), flush=True)
        return 0
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters())
    flops = (6 * n_params + 12 * args.n_layer * args.seq * 768) * args.batch * args.seq
    peak = PEAK_TFLOPS.get(torch.cuda.get_device_name(), {}).get(args.dtype)
    print("RESULT " + json.dumps({
        "tok_s": args.batch * args.seq / step_s, "ms": step_s * 1e3,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "compile_s": compile_s,
        "mfu": flops / step_s / peak if peak else None, "loss": float(loss), "torch": torch.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
