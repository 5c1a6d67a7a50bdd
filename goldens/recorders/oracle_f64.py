"""The float64 oracle of HF's forward pass, computed layer by layer.

record_hf.py --dtype float64 and record_next_token.py --source oracle call
to_float64(model) on the float32 model they loaded, then run every forward
under an F32Guard. The model is NOT converted to float64 as a whole (a 7B
model would need 56 GB in float64 beside its float32 copy). The embedding,
the final norm and the LM head (one Parameter when tied) are widened to
float64 once, block by block, their float32 freed (widen_in_place): they are
needed whole by every forward, and held in float64 they cost their float32
size once more, not twice. Each decoder layer stays in float32 and gets
float64 copies of its parameters for the duration of its own forward only
(a forward pre-hook widens them, a forward hook puts the float32 tensors
back and the copies are freed). Activations, the KV cache, the RoPE tables,
the mask and the logits are float64 throughout, exactly as when the whole
model was converted, so every op sees the same float64 operands:
float32 -> float64 is exact, and the widened weights are fresh, contiguous
allocations (64-byte aligned) as model.to(torch.float64) made them. The
oracles are byte-identical to those of the whole-model conversion (checked
on the committed models: docs/goldens.md). Why not the LM head in blocks of
rows too: a float64 matmul over a slice of the vocabulary rounds differently
from the whole one (up to 1e-14 apart for more than a few tokens, measured),
and the oracle would no longer be the one recorded.

Memory while recording, F the float32 model, E its embedding and LM head
(once if tied), L its largest decoder layer, all in float32 bytes:
    F + E + 2L                  the model, with E held in float64 (2E in
                                place of E) and one layer's float64 copy
  + 64 MiB                      while E is widened (one block)
  + the activations             float64 hidden states, the KV cache, every
                                layer's attention probabilities [H,T,S] and
                                the logits [T,V] of the prompt (MB for the
                                committed prompts)
  + the interpreter             python with torch and transformers (~0.7
                                GiB, measured before loading: BASE_RSS)
E + 2L <= F for any model with 2 or more equal decoder layers (F >= E + 2L),
so the model's part is within 2F. Loading comes first and peaks on its own,
in float32 (hf_loading.py's lean_gguf_loading and fresh_weights keep it near
F plus the loader's own metadata); the `memory:` line every HF recording
prints reports the whole run's peak RSS against F.

Three places of HF's code compute in float32 whatever the model's dtype, and
are replaced for the run by the same formulas in float64: the RoPE cos/sin
tables (a scaled RoPE's too, chosen per forward as HF does: rope_scaling_f64.py), RMSNorm (q_norm/k_norm included; Gemma 3's own 1 + w variant) and the
eager attention softmax (see record_hf.py's docstring). F32Guard, a dispatch
mode, counts every aten op whose output is a floating tensor of another dtype
than float64; a run must end with none, outside the `allowed` sections (the
rounding of stored tensors to float32, the recorders' float32 bookkeeping).
"""
import collections
import resource
import sys
import types

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import rope_scaling_f64

GIB = 1 << 30


class F32Guard(TorchDispatchMode):
    """Counts every aten op (outside `allowed` sections) whose output is a
    floating tensor of another dtype than float64: a float64 run must have
    none."""

    def __init__(self):
        super().__init__()
        self.allow = 0
        self.bad = collections.Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.allow:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                    self.bad[f"{func} -> {t.dtype}"] += 1
        return out


class allowed:
    """Lets the guard (if any) ignore the ops inside: the rounding to float32
    of what is stored, and the recorder's own float32 bookkeeping."""

    def __init__(self, guard):
        self.guard = guard

    def __enter__(self):
        if self.guard is not None:
            self.guard.allow += 1

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.allow -= 1


def rope_default_f64(cfg, layer_type=None):
    """inv_freq of HF's `default` RoPE (compute_default_rope_parameters) in
    float64: 1 / theta^(2i/dim), dim = head_dim * partial_rotary_factor.
    `layer_type`: Gemma 3 keeps one set of RoPE parameters per layer type
    (rope_parameters[layer_type])."""
    rp = cfg.rope_parameters if layer_type is None else cfg.rope_parameters[layer_type]
    if rp.get("rope_type", "default") != "default":
        # (a scaled RoPE without layer types is rope_scaling_f64's)
        sys.exit(f"record_hf.py: --dtype float64 supports rope_type `default` only here, not {rp['rope_type']!r}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    return 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


# Rows of a matrix widened at a time (widen_in_place): 64 MiB of float32,
# above glibc's largest mmap threshold (32 MiB), so that every block is its
# own mapping and goes back to the system the moment it is freed.
BLOCK = 64 << 20


def widen_in_place(p):
    """Replace the float32 data of parameter `p` by a float64 copy without
    ever holding both whole (they would be 3x its float32 size): its rows are
    first copied into blocks (the float32 matrix freed), then each block is
    widened into the float64 matrix and freed. Peak: the matrix in float64
    plus one block. Returns the float64 size in bytes."""
    f32 = p.data
    shape, n_rows = f32.shape, f32.shape[0]
    rows = max(1, BLOCK // max(1, f32[:1].numel() * 4))
    blocks = [f32[a:a + rows].clone() for a in range(0, n_rows, rows)]
    # Nothing else holds the loader's matrix (every parameter was
    # re-allocated after loading): this frees it.
    p.data = torch.empty(0, dtype=torch.float32)
    del f32
    # Untouched pages of a fresh allocation are not resident: the float64
    # matrix grows as the blocks shrink. But under deterministic algorithms
    # (make_deterministic) torch.empty fills new memory with NaN, touching
    # every page at once (the whole float64 matrix beside all the blocks):
    # not for this one, whose every element is written below (asserted). A
    # fresh allocation (64-byte aligned), as model.to(torch.float64) made;
    # float32 -> float64 is exact.
    det = torch.utils.deterministic
    fill, det.fill_uninitialized_memory = det.fill_uninitialized_memory, False
    try:
        f64 = torch.empty(shape, dtype=torch.float64)
    finally:
        det.fill_uninitialized_memory = fill
    a = 0
    for i in range(len(blocks)):
        n = blocks[i].shape[0]
        f64[a:a + n].copy_(blocks[i])
        blocks[i] = None
        a += n
    assert a == n_rows
    p.data = f64
    return f64.numel() * 8


def stream_float64(model):
    """Makes the float64 weights of a forward: the embedding, the final
    norm and the LM head (a tied one is the embedding's Parameter) are
    widened once, for good (widen_in_place); every decoder layer gets
    float64 copies of its parameters for its own forward only (a forward
    pre-hook widens them, a forward hook puts the float32 tensors back and
    the copies are freed). Every parameter is one or the other (asserted),
    so no float32 weight reaches a forward unseen (the guard would count it,
    too). Returns (bytes held in float64 for good, the largest decoder layer
    in float64)."""
    m = model.model
    layers = list(m.layers)
    streamed = {id(p) for layer in layers for p in layer.parameters()}
    kept = {id(p): p for mod in (m.embed_tokens, m.norm, model.lm_head) for p in mod.parameters()}
    assert not streamed & set(kept), "a parameter is both in a decoder layer and outside them"
    stray = [n for n, p in model.named_parameters() if id(p) not in streamed and id(p) not in kept]
    assert not stray, f"parameters outside the decoder layers, embedding, final norm and LM head: {stray}"
    held = sum(widen_in_place(p) for p in kept.values())
    widened = set()  # id() of the parameters holding float64 copies now
    largest = 0
    for li, layer in enumerate(layers):
        # Each Parameter with its float32 tensor, taken here, outside any
        # forward: reading `p.data` under the guard would be an aten.detach
        # to float32 (counted). Widening is then one _to_copy to float64, and
        # putting the float32 tensor back is set_data (no output).
        params = [(p, p.data) for p in layer.parameters()]
        largest = max(largest, sum(p.numel() for p, _ in params) * 8)
        live = []

        def widen(mod, args, li=li, params=params, live=live):
            assert not live, f"layer {li}: entered twice"
            for p, f32 in params:
                # Nothing else may have replaced the weights since.
                assert id(p) not in widened and p.dtype == torch.float32 and p.data_ptr() == f32.data_ptr(), \
                    f"layer {li}: a parameter is not the float32 tensor it was"
                widened.add(id(p))
                # float32 -> float64 is exact; the copy is a fresh allocation,
                # as model.to(torch.float64) made.
                p.data = f32.to(torch.float64)
                live.append((p, f32))

        def narrow(mod, args, out, live=live):
            # Put the float32 tensors back; the float64 copies are freed here.
            for p, f32 in live:
                p.data = f32
                widened.discard(id(p))
            live.clear()
        layer.register_forward_pre_hook(widen, prepend=True)
        layer.register_forward_hook(narrow, always_call=True)
    return held, largest


def rms_forward_f64(self, hidden_states):
    """An RMSNorm's forward in float64 (HF's own RMSNorm casts to float32
    inside): the method every RMSNorm of an oracle model runs
    (record_vlm.py's oracle uses it too)."""
    assert hidden_states.dtype == torch.float64 and self.weight.dtype == torch.float64
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states


def to_float64(model, guard=None):
    """Make every forward of `model` the float64 oracle: parameters widened
    unit by unit while they are used (stream_float64), buffers (RoPE
    inv_freq, Gemma 3's embed_scale) in float64 for good, and HF's float32
    islands replaced (see the module docstring). A scaled RoPE (linear,
    dynamic, yarn, longrope, llama3) becomes rope_scaling_f64's float64
    forward, its table per forward checked against a float32 HF rotary
    module run beside it (under `guard`'s allowed sections): the model's
    `oracle_rope`. Returns what was patched, for the log and
    record_next_token.py's provenance (`settings.float64`, unchanged from
    the whole-model conversion's; `rope` names the scaling)."""
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights are not all float32"
    # Buffers are small: widened once, as model.to(torch.float64) did.
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_floating_point():
                mod._buffers[bname] = buf.to(torch.float64)
    m = model.model
    # RoPE tables.
    rot = m.rotary_emb
    rope = "float64 default"
    if type(rot).__name__ == "Gemma3RotaryEmbedding":
        # One table per layer type, each from its own rope_theta:
        # forward(x, position_ids, layer_type) reads `{layer_type}_inv_freq`.
        inv64s = {}
        for lt in rot.layer_types:
            inv64s[lt] = rope_default_f64(model.config, lt)
            assert rot.rope_type[lt] == "default" and getattr(rot, f"{lt}_attention_scaling") == 1.0, lt
            hf_inv = getattr(rot, f"{lt}_inv_freq")
            assert hf_inv.shape == inv64s[lt].shape, lt
            assert torch.allclose(hf_inv.to(torch.float64), inv64s[lt], rtol=1e-6, atol=0), \
                f"{lt}: inv_freq differs from HF's"
        # The two bases differ, so a table mix-up cannot go unseen.
        assert len(inv64s) < 2 or not torch.equal(*inv64s.values())

        def rope_forward(self, x, position_ids, layer_type):
            freqs = position_ids[..., None].to(torch.float64) * inv64s[layer_type]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        rope = {lt: f"float64 default, theta {model.config.rope_parameters[lt]['rope_theta']}" for lt in inv64s}
    elif rope_scaling_f64.is_scaled(model.config):
        # The scaling's table in float64, chosen per forward as HF does.
        oracle_rope = rope_scaling_f64.OracleRope(rot, model.config, guard, allowed)
        model.oracle_rope = oracle_rope

        def rope_forward(self, x, position_ids):
            return oracle_rope.forward(x, position_ids)
        rope = rope_scaling_f64.describe(model.config)
    else:
        inv64 = rope_default_f64(model.config)
        assert rot.inv_freq.shape == inv64.shape and rot.attention_scaling == 1.0
        # HF's float32 inv_freq is the float64 one rounded (within a few ulps).
        assert torch.allclose(rot.inv_freq.to(torch.float64), inv64, rtol=1e-6, atol=0), "inv_freq differs from HF's"

        def rope_forward(self, x, position_ids):
            freqs = position_ids[..., None].to(torch.float64) * inv64
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot.forward = types.MethodType(rope_forward, rot)
    # RMSNorm (every norm of these architectures, q_norm/k_norm included).
    # Their weights are float64 only while their unit runs: asserted per call.
    norms = 0
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls == "Gemma3RMSNorm":
            # Gemma 3: x * rsqrt(mean(x^2) + eps) * (1 + w), HF's order of
            # operations (Gemma3RMSNorm.forward), in float64.
            assert hasattr(mod, "eps"), name

            def gemma_rms_forward(self, x):
                assert x.dtype == torch.float64 and self.weight.dtype == torch.float64
                out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
                return out * (1.0 + self.weight)
            mod.forward = types.MethodType(gemma_rms_forward, mod)
            norms += 1
        elif cls.endswith("RMSNorm"):
            assert hasattr(mod, "variance_epsilon"), name
            mod.forward = types.MethodType(rms_forward_f64, mod)
            norms += 1
        else:
            assert "Norm" not in cls, f"{name}: {cls} has no float64 replacement"
    softmax_float64()
    # Mixture-of-experts routers (their softmax is float32 in HF's code): float64 forwards.
    import moe_hooks
    routers = moe_hooks.to_float64(model)
    # Last: the hooks only widen what the patches above expect.
    model.oracle_f64_bytes = stream_float64(model)
    out = {"rope": rope, "rmsnorm_modules": norms, "softmax": "float64"}
    if routers:  # MoE models only (the others' provenance is unchanged)
        out["moe_routers"] = routers
    return out


def softmax_float64():
    """Softmax in float64 where HF asks for float32: eager_attention_forward
    asks for dtype=torch.float32 and casts back; in a float64 run it is
    computed in float64 instead (torch.nn.functional.softmax, patched)."""
    real_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and input.dtype == torch.float64:
            dtype = torch.float64
        return real_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
    torch.nn.functional.softmax = softmax


def f32_bytes(model):
    """The model's size in float32: its parameters (a tied matrix once) and
    buffers, 4 bytes each."""
    return 4 * (sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()))


def peak_rss():
    """This process's peak resident set size so far, in bytes (Linux: kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# The interpreter with torch and transformers imported, before any model:
# a constant of the process, not of the model (about 0.7 GiB).
BASE_RSS = peak_rss()


def size(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def memory_line(model_bytes, f64_bytes=None):
    """The `memory:` progress line goldens regen keeps in its review: the
    peak RSS of the whole run (loading included) against the float32 model,
    also without the interpreter's own RSS before loading (what the model
    costs). `f64_bytes`: stream_float64's (held, largest layer)."""
    peak = peak_rss()
    line = (f"memory: peak RSS {size(peak)}, the model in float32 {size(model_bytes)}: {peak / model_bytes:.2f}x "
            f"({(peak - BASE_RSS) / model_bytes:.2f}x above the {size(BASE_RSS)} of the interpreter and libraries)")
    if f64_bytes is not None:
        held, largest = f64_bytes
        line += (f"; float64: embedding, final norm and LM head {size(held)} (their float32 freed), "
                 f"decoder layers streamed, one at a time ({size(largest)})")
    return line
