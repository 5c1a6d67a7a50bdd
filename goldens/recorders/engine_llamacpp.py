#!/usr/bin/env python3
"""llama.cpp as an engine under test: touchstone's subprocess protocol,
version 1, served on stdin/stdout (`touchstone run SPEC --engine llama.cpp`).

usage: engine_llamacpp.py [--threads N] [--rope-freq-base X]
                          [--flash-attn auto|on|off] [--kv-type f16|f32]

It runs the libllama that build_llamacpp.py builds from the pinned
llama-cpp-python sdist, through that sdist's ctypes bindings (loaded as
record_llamacpp.py loads them), WITH LLAMA.CPP'S DEFAULTS: flash attention
`auto` (enabled on the CPU backend), an f16 K/V cache, and its own quantised
kernels (each matmul's activations quantised to the weight's vec_dot type:
Q8_K blocks of 256 for K-quants, Q8_0 blocks of 32 for the legacy quants).
Only what a protocol engine must fix differs from llama-cli: one thread by
default (--threads; ggml computes every output element on one thread in a
fixed order, so the count changes speed, not bits), logits of every row of
a batch (the prefill's rows are all reported; the graph then keeps every row
through the last layer), and a fresh context per run (nothing of one run
leaks into the next).

Stages come from ggml's eval callback through llamacpp_graph.py's NODE_MAP
(the recorders' own canonical(): the same names, layouts, Q/K un-permutation
for Llama and fused-projection splits for Phi-3). With flash attention the
graph has one FLASH_ATTN_EXT node per layer and no score or probability
tensor: the load answer says so (`cannot_tap` blk.*.attn_scores and
blk.*.attn_probs, with `why`), and attn_ctx is the flash kernel's output
(kqv_out-L, a RESHAPE instead of the CONT of the unfused path). Whether
`auto` enabled flash attention is not guessed: load runs one token through a
probe context and looks for FLASH_ATTN_EXT in the graph. When only the
logits are tapped no callback is installed at all (the untapped path); the
logits are llama_get_logits_ith's, which equal the graph's result_output.

The load answer's `arithmetic` is derived, not assumed: {storage: f32,
activations, kv, act}. activations is the coarsest quantisation among the
vec_dot types (ggml_get_type_traits_cpu) of the weights the model multiplies
by (every 2-D weight but token_embd, which is only gathered unless the head
is tied to it): q8_k when any is Q8_K (K-quants), else q8_0, else exact (F32
weights, the tiny models' GGUFs: nothing is quantised). kv is the cache's
type (f16 by default; f16 whatever --kv-type says under flash attention,
which casts an f32 cache to f16 for its kernel); act is f16 for Gemma 3 (ggml's CPU GEGLU evaluates
GELU on an f16 input from an f16 table), else f32. Storage other than f32 is
refused: llama.cpp computes with the GGUF's own tensor types.

Sampling is llama.cpp's sampler chain: temp, top_k, top_p (min_keep 1),
then dist, seeded with the request's seed reduced mod 2^32 - 1 (dist takes a
uint32, and 0xFFFFFFFF means "random seed" to llama.cpp, so it never gets
it): one seed gives the same tokens every run, another seed other tokens.
The order is HF's (temperature first), so `sample_probs` (dist's normalised
probabilities, 0 for removed tokens) is comparable with HF's processors.
Greedy is argmax (the lowest index of a tie), as llama.cpp's greedy sampler.

tokenize: llama_tokenize with add_special (the model's BOS rule) and
parse_special; with chat, the GGUF's own chat template
(tokenizer.chat_template) rendered by Jinja with HF's settings, as
llama-server --jinja renders it, then tokenised without added specials.

--rope-freq-base X plants a bug for tests: the context is created with
rope_freq_base X instead of the model's (0 = from the GGUF), so every
position but 0 is rotated by wrong angles; touchstone's first divergence is
prefill/blk.0.q_rope. The engine then calls itself `llama.cpp+rope-freq-base=X`.
--flash-attn and --kv-type override llama.cpp's defaults (on/off and f32 make
a different engine: the answer's capabilities and arithmetic follow).

Log lines go to stderr (libllama's own log is silenced except errors);
stdout carries protocol responses only.
"""
import argparse
import ctypes
import os
import sys

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_protocol import Engine, EngineError, logger, serve  # noqa: E402
import build_llamacpp  # noqa: E402
import golden_io  # noqa: E402
import llamacpp_graph as G  # noqa: E402  (the recorders' node map and canonical())
import llamacpp_lib as L  # noqa: E402  (the recorders' bindings and eval callback)

NAME = "llama.cpp"
FA = {"auto": -1, "off": 0, "on": 1}  # LLAMA_FLASH_ATTN_TYPE_*
GGML_TYPE = {"f32": 0, "f16": 1}
GGML_Q8_0, GGML_Q8_K = 8, 15
MODEL_TYPE = {"gemma3": "gemma3_text"}  # GGUF architecture -> HF model_type, where they differ
CTX_DEFAULT = 512  # llama_context_default_params().n_ctx
SEED_MOD = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED (random) is never passed


class TypeTraits(ctypes.Structure):
    """struct ggml_type_traits_cpu of the pinned ggml-cpu."""
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class Observer(L.NodeRecorder):
    """The eval callback: every node's name and op, and a copy of every F32
    node's data (llamacpp_lib.NodeRecorder); `probe` keeps names and ops
    only."""

    def __init__(self, g, probe=False):
        super().__init__(g)
        self.probe = probe

    def callback(self, t, ask, user_data):
        if self.probe:
            if ask:
                tt = ctypes.cast(t, ctypes.POINTER(L.GgmlTensor)).contents
                self.nodes.append({"name": tt.name.decode("utf-8"), "op": self.g.ggml_op_desc(t).decode()})
            return False  # nothing to copy: let the scheduler run the graph whole
        return super().callback(t, ask, user_data)


class LlamaCppEngine(Engine):
    name = NAME

    def __init__(self, log, args):
        super().__init__(log)
        self.args = args
        if args.rope_freq_base is not None:
            self.name = f"{NAME}+rope-freq-base={args.rope_freq_base:g}"
        self.lc = self.g = self.model = None

    # ---- load ---------------------------------------------------------------
    def bindings(self):
        if self.lc is not None:
            return
        found = build_llamacpp.find_built()
        if found is None:
            raise EngineError(
                f"libllama is not built in {build_llamacpp.DEFAULT_CACHE}: build it with `"
                f"{sys.executable} {os.path.join(HERE, 'build_llamacpp.py')}` (about 20 minutes on 2 cores; "
                "`touchstone goldens regen` and goldens/recorders/regen.sh build it too)")
        lib_dir, self.binfo = found
        self.lc, self.g = L.load_bindings(build_llamacpp.source_dir(), lib_dir)
        lc = self.lc
        # libllama's log: errors only, to stderr (the protocol owns stdout).
        self.quiet = lc.llama_log_callback(
            lambda level, text, ud: sys.stderr.write("[libllama] " + text.decode(errors="replace"))
            if level == 4 else None)  # GGML_LOG_LEVEL_ERROR
        lc.llama_log_set(self.quiet, None)
        lc.llama_backend_init()
        cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"))
        cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraits)
        self.cpu = cpu

    def load_model(self, path, storage):
        if os.path.isdir(path):
            sibling = os.path.join(os.path.dirname(os.path.abspath(path)), "model.gguf")
            hint = f" (the GGUF next to it: --model {sibling})" if os.path.isfile(sibling) else \
                " (goldens/recorders/convert_gguf.py converts an HF folder)"
            raise EngineError(f"{path} is a folder: llama.cpp runs .gguf files; give touchstone run "
                              f"--model FILE.gguf{hint}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise EngineError(f"{path} is not a GGUF file (no GGUF magic)")
        if storage != "f32":
            raise EngineError(f"storage {storage!r}: llama.cpp computes with the GGUF's own tensor types and "
                              "f32 activations; this engine runs storage f32 only")
        self.bindings()
        lc = self.lc
        if self.model is not None:
            lc.llama_model_free(self.model)
            self.model = None
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        model = lc.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise EngineError(f"libllama could not load {path} (an architecture or tensor type this llama.cpp "
                              "does not know?)")
        self.model = model
        self.vocab_p = lc.llama_model_get_vocab(model)
        self.vocab = lc.llama_vocab_n_tokens(self.vocab_p)
        arch = self.meta("general.architecture")
        if arch not in G.ROPE_TYPE:
            raise EngineError(f"architecture {arch!r} has no node map in llamacpp_graph.py "
                              f"(known: {sorted(G.ROPE_TYPE)})")
        self.arch = arch
        self.model_type = MODEL_TYPE.get(arch, arch)
        n = int(self.meta(f"{arch}.block_count"))
        H = int(self.meta(f"{arch}.attention.head_count"))
        KV = int(self.meta(f"{arch}.attention.head_count_kv") or H)
        E = int(self.meta(f"{arch}.embedding_length"))
        D = int(self.meta(f"{arch}.attention.key_length") or E // H)
        F = int(self.meta(f"{arch}.feed_forward_length"))
        self.n_layer = n
        self.dims = golden_io.model_dims({"num_attention_heads": H, "num_key_value_heads": KV, "head_dim": D,
                                          "hidden_size": E, "intermediate_size": F, "vocab_size": self.vocab,
                                          "num_hidden_layers": n})
        self.known_stages = set(golden_io.all_stages(self.model_type, n, ["sample_probs"]))
        self.absent_stages = set(golden_io.all_stages("gemma3_text", n)) - self.known_stages
        self.attn = self.attention(arch, n, D)
        self.fa = self.probe_flash_attention()
        arithmetic = self.arithmetic(path, arch)
        answer = {"arithmetic": arithmetic, "tokenize": True}
        if self.fa:
            answer["cannot_tap"] = ["blk.*.attn_scores", "blk.*.attn_probs"]
            answer["why"] = ("flash attention (llama.cpp's default `auto` enables it here): one fused "
                             "FLASH_ATTN_EXT kernel per layer never materialises the attention scores or "
                             "probabilities")
        self.log(f"{arch} `{self.meta('general.name')}`, {n} layers, E {E}, H {H}, KV {KV}, D {D}, F {F}, "
                 f"V {self.vocab}; flash attention {'on' if self.fa else 'off'} ({self.args.flash_attn}), "
                 f"KV cache {self.args.kv_type}, {self.args.threads} thread(s); llama.cpp "
                 f"{self.binfo['llama_cpp_commit'][:12]} (llama-cpp-python {self.binfo['llama_cpp_python']})")
        return answer

    def meta(self, key):
        buf = ctypes.create_string_buffer(4096)
        n = self.lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def attention(self, arch, n, D):
        """llamacpp_graph.canonical()'s `attn`: the attention scale each
        layer's softmax must apply in total, and each layer's sliding window
        (Gemma 3: llama.cpp's own pattern, every `sliding_window_pattern`-th
        layer (default 6) attends fully). Used only without flash attention,
        to cut and zero the scores."""
        windows = [None] * n
        if arch == "gemma3":
            swa = self.lc.llama_model_n_swa(self.model)
            pat = int(self.meta(f"{arch}.attention.sliding_window_pattern") or 6)
            windows = [swa if il % pat < pat - 1 else None for il in range(n)]
        return {"arch": arch, "scale": 1.0 / np.sqrt(D), "windows": windows, "rope_bases": None}

    def arithmetic(self, path, arch):
        """See the module docstring: the coarsest vec_dot type among the
        multiplied weights, the cache's type, Gemma 3's f16 GELU."""
        from gguf import GGUFReader
        tensors = {t.name: (int(t.tensor_type), len(t.shape)) for t in GGUFReader(path).tensors}
        tied = "output.weight" not in tensors
        mm = {name: t for name, (t, dims) in tensors.items()
              if name.endswith(".weight") and dims >= 2 and (name != "token_embd.weight" or tied)}
        kinds = {self.cpu.ggml_get_type_traits_cpu(t).contents.vec_dot_type for t in set(mm.values())}
        acts = "q8_k" if GGML_Q8_K in kinds else "q8_0" if GGML_Q8_0 in kinds else "exact"
        self.log(f"arithmetic: {len(mm)} multiplied weights, vec_dot types {sorted(kinds)} -> activations {acts}")
        # Flash attention casts an f32 cache to f16 before its kernel
        # (llama-graph.cpp build_attn_mha): k and v are then f16 either way.
        kv = "f16" if self.fa else self.args.kv_type
        return {"storage": "f32", "activations": acts, "kv": kv, "act": "f16" if arch == "gemma3" else "f32"}

    # ---- contexts -----------------------------------------------------------
    def context(self, n_tokens, n_prompt, observer, rope_base=None):
        lc = self.lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = max(CTX_DEFAULT, -(-n_tokens // 256) * 256)
        # The prompt must be one ubatch: the canonical prefill is one pass.
        cp.n_batch = max(cp.n_batch, n_prompt)
        cp.n_ubatch = max(cp.n_ubatch, n_prompt)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.args.threads
        cp.flash_attn_type = FA[self.args.flash_attn]
        cp.type_k = cp.type_v = GGML_TYPE[self.args.kv_type]
        if self.args.rope_freq_base is not None:
            cp.rope_freq_base = self.args.rope_freq_base
        cb = None
        if observer is not None:
            cb = lc.ggml_backend_sched_eval_callback(observer.callback)
            cp.cb_eval = cb
            cp.cb_eval_user_data = None
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise EngineError(f"llama_init_from_model failed (n_ctx {cp.n_ctx}, n_ubatch {cp.n_ubatch})")
        return ctx, cb, cp

    def decode(self, ctx, batch, toks, pos0):
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1  # every row's logits
        rc = self.lc.llama_decode(ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")

    def probe_flash_attention(self):
        """Whether this context's flash attention setting runs the fused
        kernel: one token through a probe context, graph ops listed."""
        lc = self.lc
        obs = Observer(self.g, probe=True)
        ctx, cb, cp = self.context(1, 1, obs)
        batch = lc.llama_batch_init(1, 0, 1)
        try:
            self.decode(ctx, batch, [0], 0)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        ops = {n["op"] for n in obs.nodes}
        if "FLASH_ATTN_EXT" not in ops and "SOFT_MAX" not in ops:
            raise EngineError(f"the probe graph has neither FLASH_ATTN_EXT nor SOFT_MAX: ops {sorted(ops)}")
        return "FLASH_ATTN_EXT" in ops

    # ---- run ----------------------------------------------------------------
    def run_checked(self, r):
        lc = self.lc
        keep = set(r.taps) - {"logits", "sample_probs"}
        if self.fa:
            # Stages the load answer said it cannot tap (touchstone does not
            # ask for them): not written.
            untappable = {s for s in keep if s.endswith((".attn_scores", ".attn_probs"))}
            if untappable:
                self.log(f"{len(untappable)} attn_scores/attn_probs stage(s) tapped, but flash attention never "
                         "materialises them: not written")
            keep -= untappable
        obs = Observer(self.g) if keep else None
        n_total = len(r.prompt) + r.decode_steps
        ctx, cb, cp = self.context(n_total, len(r.prompt), obs)
        batch = lc.llama_batch_init(max(cp.n_batch, len(r.prompt)), 0, 1)
        sampler = Sampler(lc, r.sampling, r.seed, self.vocab)
        permuted = self.arch in G.QK_PERMUTED
        table = self.node_map(self.arch)
        tensors, tokens = {}, []
        x, pos = list(r.prompt), 0
        try:
            for si in range(r.decode_steps + 1):
                step = "prefill" if si == 0 else f"decode{si}"
                if obs is not None:
                    obs.nodes = []
                self.decode(ctx, batch, x, pos)
                T, S = len(x), pos + len(x)
                logits = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.vocab,))
                                   .copy() for i in range(T)])
                if keep:
                    stages = G.canonical(obs.nodes, step, self.arch, self.n_layer, T, S, permuted, self.dims,
                                         keep, list(range(pos, S)), self.attn, table)
                    obs.nodes = []
                    for k, v in stages.items():
                        tensors[f"{step}/{k}"] = v
                if "logits" in r.taps:
                    tensors[f"{step}/logits"] = logits
                tok, probs = sampler(logits[-1])
                if probs is not None and "sample_probs" in r.taps:
                    tensors[f"{step}/sample_probs"] = probs[None]
                tokens.append(tok)
                pos = S
                if si < r.decode_steps:
                    x = [r.feed(si, tok)]
        finally:
            sampler.free()
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return tensors, tokens

    def node_map(self, arch):
        """The recorders' node map, with flash attention's attn_ctx: the
        fused kernel's output reshaped to [T, H*D] (kqv_out-L RESHAPE)."""
        m = G.node_map(arch)
        if not self.fa:
            return m
        return [(s, n, "RESHAPE" if s == "blk.{L}.attn_ctx" else op, sel) for s, n, op, sel in m]

    # ---- tokenize -----------------------------------------------------------
    def tokenize(self, text, chat):
        lc = self.lc
        if chat:
            text = self.render_chat(text)
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab_p, data, len(data), buf, n_max, not chat, True)
        if n < 0:
            raise EngineError(f"llama_tokenize needs {-n} tokens, more than {n_max}")
        return list(buf[:n])

    def piece(self, tok):
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.vocab_p, tok, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", errors="replace")

    def render_chat(self, user):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        tmpl = self.lc.llama_model_chat_template(self.model, None)
        if not tmpl:
            raise EngineError("the GGUF has no chat template (tokenizer.chat_template)")

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        vocab = self.vocab_p
        bos = self.piece(self.lc.llama_vocab_bos(vocab)) if self.lc.llama_vocab_bos(vocab) >= 0 else ""
        eos = self.piece(self.lc.llama_vocab_eos(vocab)) if self.lc.llama_vocab_eos(vocab) >= 0 else ""
        return env.from_string(tmpl.decode("utf-8")).render(
            messages=[{"role": "user", "content": user}], add_generation_prompt=True, bos_token=bos, eos_token=eos)


class Sampler:
    """llama.cpp's sampler chain (see the module docstring); greedy is
    argmax."""

    def __init__(self, lc, sampling, seed, vocab):
        self.lc, self.sampling, self.vocab, self.chain = lc, sampling, vocab, None
        if sampling is None:
            return
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sampling["temperature"]))
        if sampling["top_k"]:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(sampling["top_k"]))
        if sampling["top_p"] is not None:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sampling["top_p"], 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed % SEED_MOD))
        self.chain = chain
        self.data = np.zeros(vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def __call__(self, row):
        """(token, distribution [V] float32, or None for greedy)."""
        if self.chain is None:
            return int(np.argmax(row)), None
        lc = self.lc
        d = self.data
        d["id"] = np.arange(self.vocab, dtype=np.int32)
        d["logit"] = row
        d["p"] = 0.0
        arr = lc.llama_token_data_array(
            data=ctypes.cast(d.ctypes.data, lc.llama_token_data_p), size=self.vocab, selected=-1, sorted=False)
        lc.llama_sampler_apply(self.chain, ctypes.byref(arr))
        # The samplers may point `data` at their own buffer and shrink `size`.
        kept = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                     shape=(arr.size * d.dtype.itemsize,)).view(d.dtype).copy()
        if not 0 <= arr.selected < arr.size:
            raise EngineError(f"llama.cpp's sampler selected index {arr.selected} of {arr.size}")
        tok = int(kept["id"][arr.selected])
        lc.llama_sampler_accept(self.chain, tok)
        probs = np.zeros(self.vocab, dtype=np.float32)
        probs[kept["id"]] = kept["p"]
        return tok, probs

    def free(self):
        if self.chain is not None:
            self.lc.llama_sampler_free(self.chain)
            self.chain = None


def main():
    ap = argparse.ArgumentParser(description="llama.cpp (libllama) as a touchstone engine under test (subprocess "
                                             "protocol 1: JSON lines on stdin/stdout; see the module docstring)")
    ap.add_argument("--threads", type=int, default=1, help="ggml threads (default 1; bits do not depend on it)")
    ap.add_argument("--rope-freq-base", type=float, default=None, metavar="X",
                    help="PLANTED BUG for tests: create the context with RoPE base X instead of the model's")
    ap.add_argument("--flash-attn", choices=sorted(FA), default="auto",
                    help="flash attention (default auto: llama.cpp's default)")
    ap.add_argument("--kv-type", choices=sorted(GGML_TYPE), default="f16",
                    help="K and V cache type (default f16: llama.cpp's default)")
    args = ap.parse_args()
    log = logger(NAME)
    log(f"protocol 1, pid {os.getpid()}; waiting for requests on stdin")
    return serve(LlamaCppEngine(log, args), log)


if __name__ == "__main__":
    sys.exit(main())
