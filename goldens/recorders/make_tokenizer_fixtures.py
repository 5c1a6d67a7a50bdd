#!/usr/bin/env python3
"""Token-id fixtures for touchstone's tokenizer (src/tokenizer/): a set of
texts tokenised by every reference for every model, written to one JSON file
that `cargo test` compares our ids with (tests/tokenizer.rs).

    python goldens/recorders/make_tokenizer_fixtures.py OUT.json [--real-gguf PATH] [--no-llamacpp]

Run it with the pinned recorder environment (requirements.txt;
`goldens/recorders/regen.sh` and `touchstone goldens regen` create it as
$TOUCHSTONE_CACHE/recorders-venv, default ~/.cache/touchstone/recorders-venv): transformers'
GGUF reader imports torch, and build_llamacpp.py needs the pinned cmake. The
committed fixture is
`tests/fixtures/tokenizer.json`; regenerate it with

    ~/.cache/touchstone/recorders-venv/bin/python goldens/recorders/make_tokenizer_fixtures.py tests/fixtures/tokenizer.json \
        --real-gguf ~/.cache/touchstone/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

(the real model comes from ci/fetch_real_model.py; without --real-gguf its
section is left out and the Rust test reports it ignored).

Sources, per model (a source that cannot apply is left out and says why in
`notes`):

- `hf_dir`: transformers `AutoTokenizer.from_pretrained(FOLDER)`; plain text is
  `tok(text)["input_ids"]` (add_special_tokens=True: what the model's
  post-processor adds, e.g. a BOS), chat is `tok.apply_chat_template([{"role":
  "user", "content": text}], add_generation_prompt=True, tokenize=True)`.
- `hf_gguf`: the same calls on `AutoTokenizer.from_pretrained(DIR,
  gguf_file=NAME)`: transformers' own conversion of the GGUF vocabulary.
- `llamacpp`: libllama's `llama_tokenize` on the GGUF (built from the pinned
  llama-cpp-python sdist by build_llamacpp.py, loaded vocab-only through the
  sdist's ctypes bindings as record_llamacpp.py does). Plain text:
  add_special=True, parse_special=True, as llama.cpp's own programs tokenise a
  prompt (`common_tokenize(ctx, prompt, true, true)`). Chat: llama.cpp has no
  Jinja in libllama, so the text HF rendered is tokenised with
  add_special=False, parse_special=True, as `apply_chat_template` encodes it
  (the template writes any BOS itself).

gguf-py comes from the same sdist (gguf 0.19.0, not pip-installed), as for
convert_gguf.py; transformers needs it to read a GGUF's vocabulary.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402

# The texts: each exercises one part of a byte-level BPE tokenizer.
TEXTS = {
    "ascii_prose": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; isn't it?",
    "python_code": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "digits": "12345678",
    "digits_mixed": "x = 3.14159 * 1000000 + 42",
    "emoji_cjk": "Hi 👋🏽! 世界你好，こんにちは 한국어 🤖",
    "combining_accents": "cafe\u0301 nai\u0308ve Ångström re\u0301sume\u0301",
    "precomposed_accents": "café naïve résumé",
    "leading_trailing_spaces": "   leading and trailing   ",
    "tabs_crlf": "\tindent\r\n\t\tmore\r\n",
    "contractions": "I'LL say we've DON'T they'd",
    "special_chatml": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "special_llama3": "<|begin_of_text|>hi<|eot_id|>",
    "empty_line_run": "first\n\n\n\nsecond\n\n",
    "only_newlines": "\n\n\n",
    "spec_prompt": "def fib(n):",
    "golden_prompt": "Golden tensors check every stage.",
    # specs/qwen2.5-0.5b.yaml's prompt.
    "real_spec_prompt": "# Return the n-th Fibonacci number.\ndef fib(n):\n    if n < 2:\n",
}
# Texts also rendered through the chat template (models that have one).
CHAT_TEXTS = ["ascii_prose", "python_code", "spec_prompt", "real_spec_prompt", "emoji_cjk", "special_chatml"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def import_gguf(src):
    """gguf-py from the sdist; transformers asks for its version, which a
    path-imported package lacks, so it is set from its pyproject."""
    gguf_py = os.path.join(src, "vendor", "llama.cpp", "gguf-py")
    sys.path.insert(0, gguf_py)
    import gguf

    with open(os.path.join(gguf_py, "pyproject.toml")) as f:
        ver = next(line.split('"')[1] for line in f if line.startswith("version"))
    gguf.__version__ = ver
    return ver


def hf_ids(tok, text):
    return list(tok(text)["input_ids"])


def hf_chat(tok, text):
    msgs = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return rendered, [int(i) for i in ids]


class LlamaCpp:
    def __init__(self, cache):
        lib_dir, self.build = build_llamacpp.ensure_built(cache)
        src = build_llamacpp.source_dir(cache)
        import record_llamacpp

        self.lc, _ = record_llamacpp.load_bindings(src, lib_dir)
        self.lc.llama_backend_init()
        self.models = {}

    def vocab(self, gguf):
        lc = self.lc
        if gguf not in self.models:
            p = lc.llama_model_default_params()
            p.vocab_only = True
            p.n_gpu_layers = 0
            m = lc.llama_model_load_from_file(gguf.encode(), p)
            assert m, f"llama.cpp could not load {gguf}"
            self.models[gguf] = (m, lc.llama_model_get_vocab(m))
        return self.models[gguf][1]

    def tokenize(self, gguf, text, add_special, parse_special):
        lc = self.lc
        vocab = self.vocab(gguf)
        b = text.encode()
        cap = 4 * len(b) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, b, len(b), buf, cap, add_special, parse_special)
        assert n >= 0, f"llama_tokenize failed ({n})"
        return list(buf[:n])


def record_model(name, folder, gguf, lcpp, notes):
    from transformers import AutoTokenizer

    out = {"files": {}, "plain": {}, "chat": {}, "rendered": {}, "decoded": {}}
    toks = {}
    if folder:
        toks["hf_dir"] = AutoTokenizer.from_pretrained(folder)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            out["files"][f"model/{f}"] = sha256(os.path.join(folder, f))
    else:
        notes.append(f"{name}: no HF folder (only the GGUF is available), so no `hf_dir` source")
    if gguf:
        toks["hf_gguf"] = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        out["files"]["gguf"] = sha256(gguf)
    for key, text in TEXTS.items():
        row = {src: hf_ids(t, text) for src, t in toks.items()}
        if lcpp and gguf:
            row["llamacpp"] = lcpp.tokenize(gguf, text, True, True)
        out["plain"][key] = row
        # HF's own decoding of its ids (skip_special_tokens=False), for the decoder test.
        first = next(iter(toks))
        out["decoded"][key] = {first: toks[first].decode(row[first])}
    for src, t in toks.items():
        if not t.chat_template:
            notes.append(f"{name}: `{src}` has no chat template, so no chat fixtures from it")
            continue
        for key in CHAT_TEXTS:
            rendered, ids = hf_chat(t, TEXTS[key])
            out["chat"].setdefault(key, {})[src] = ids
            prev = out["rendered"].setdefault(key, rendered)
            assert prev == rendered, f"{name}: {src} renders {key} differently"
            if lcpp and gguf and "llamacpp" not in out["chat"][key]:
                out["chat"][key]["llamacpp"] = lcpp.tokenize(gguf, rendered, False, True)
    return out


def record_chat_folder(real_gguf, notes):
    import shutil
    import tempfile

    import gguf

    r = gguf.GGUFReader(real_gguf)
    field = r.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    src = os.path.join(ROOT, "goldens", "qwen2-tiny", "model")
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = template
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(os.path.join(src, "tokenizer.json"), d)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        out = record_model("qwen2-tiny-chat", d, None, None, notes)
    out["files"] = {"model/tokenizer.json": sha256(os.path.join(src, "tokenizer.json"))}
    out["tokenizer_config"] = config
    return out


# Every pre-tokenizer name touchstone implements (src/tokenizer/pre.rs), each
# checked on the texts below with qwen2-tiny's vocabulary under that name.
PRE_NAMES = [
    "qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral",
    "dbrx", "smaug-bpe", "chatglm-bpe", "gpt-2", "phi-2", "mpt", "olmo", "jais", "deepseek-llm", "deepseek-v3",
    "falcon", "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "poro-chat",
    "bloom", "gpt3-finnish", "tekken", "gpt-4o", "llama4", "seed-coder",
]
PRE_TEXTS = ["ascii_prose", "python_code", "digits", "digits_mixed", "contractions", "tabs_crlf",
             "leading_trailing_spaces", "empty_line_run", "emoji_cjk", "combining_accents", "real_spec_prompt"]


def with_pre(src_gguf, pre, out):
    """A vocabulary-only copy of `src_gguf` (its metadata, no tensors) whose
    `tokenizer.ggml.pre` is `pre`: llama.cpp then tokenises with that
    pre-tokenizer. The other key-value pairs are copied byte for byte."""
    import struct
    import gguf

    r = gguf.GGUFReader(src_gguf)
    kvs = []
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if name == "tokenizer.ggml.pre":
            k, v = name.encode(), pre.encode()
            kvs.append(struct.pack("<Q", len(k)) + k + struct.pack("<I", int(gguf.GGUFValueType.STRING))
                       + struct.pack("<Q", len(v)) + v)
        else:
            kvs.append(b"".join(bytes(part.tobytes()) for part in field.parts))
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    body += b"\0" * (-len(body) % 32)
    with open(out, "wb") as f:
        f.write(body)


def record_pre_tokenizers(lcpp, work, src, tag):
    """llama.cpp's ids for each implemented pre-tokenizer name on the
    vocabulary of `src` (the tiny one always; the real 151k-token one, whose
    merges make every split difference show, when given)."""
    out = {"gguf": sha256(src), "texts": PRE_TEXTS, "ids": {}}
    for pre in PRE_NAMES:
        path = os.path.join(work, f"{tag}-pre-{pre}.gguf")
        with_pre(src, pre, path)
        out["ids"][pre] = {key: lcpp.tokenize(path, TEXTS[key], True, True) for key in PRE_TEXTS}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--real-gguf", help="the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (ci/fetch_real_model.py)")
    ap.add_argument("--no-llamacpp", action="store_true", help="HF sources only (no libllama build)")
    ap.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE)
    args = ap.parse_args()
    cache = os.path.abspath(args.cache_dir)

    src = build_llamacpp.source_dir(cache)
    gguf_version = import_gguf(src)
    lcpp = None if args.no_llamacpp else LlamaCpp(cache)
    import tokenizers
    import transformers

    notes = []
    if lcpp is None:
        notes.append("llama.cpp not run (--no-llamacpp): no `llamacpp` source")
    models = {}
    for name in ("qwen2-tiny", "llama-tiny"):
        d = os.path.join(ROOT, "goldens", name)
        models[name] = record_model(name, os.path.join(d, "model"), os.path.join(d, "model.gguf"), lcpp, notes)
    if args.real_gguf:
        real = os.path.abspath(args.real_gguf)
        models["qwen2.5-coder-0.5b-instruct-q4_k_m"] = record_model(
            "qwen2.5-coder-0.5b-instruct-q4_k_m", None, real, lcpp, notes)
        # The chat template from an HF folder (tokenizer_config.json), checked
        # against HF too: the tiny Qwen2 tokenizer with the real model's
        # template added to its tokenizer_config.json (the test rebuilds the
        # same folder from the fixture).
        models["qwen2-tiny-chat"] = record_chat_folder(real, notes)
    else:
        notes.append("real model not recorded (no --real-gguf), nor qwen2-tiny-chat (its template comes from it)")

    pre_tokenizers = None
    if lcpp is not None:
        import tempfile
        with tempfile.TemporaryDirectory() as work:
            tiny = os.path.join(ROOT, "goldens", "qwen2-tiny", "model.gguf")
            pre_tokenizers = {"qwen2-tiny": record_pre_tokenizers(lcpp, work, tiny, "tiny")}
            if args.real_gguf:
                pre_tokenizers["qwen2.5-coder-0.5b-instruct-q4_k_m"] = record_pre_tokenizers(
                    lcpp, work, os.path.abspath(args.real_gguf), "real")
    else:
        notes.append("pre-tokenizers not recorded (they are llama.cpp's)")

    doc = {
        "format": "touchstone-tokenizer-fixtures/1",
        "generator": "goldens/recorders/make_tokenizer_fixtures.py",
        "versions": {
            "python": sys.version.split()[0],
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gguf": gguf_version,
            "llama-cpp-python": build_llamacpp.pinned_version(),
            "llama.cpp": (lcpp.build.get("llama_cpp_commit") if lcpp else None),
        },
        "settings": {
            "hf_plain": "tok(text)['input_ids'] (add_special_tokens=True)",
            "hf_chat": "apply_chat_template([{role: user, content: text}], add_generation_prompt=True, tokenize=True)",
            "llamacpp_plain": "llama_tokenize(add_special=True, parse_special=True)",
            "llamacpp_chat": "llama_tokenize(HF-rendered text, add_special=False, parse_special=True)",
        },
        "texts": TEXTS,
        "notes": notes,
        "models": models,
        "pre_tokenizers": pre_tokenizers,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1, sort_keys=True)
        f.write("\n")
    for name, m in models.items():
        srcs = sorted({s for row in m["plain"].values() for s in row})
        agree = sum(len({tuple(v) for v in row.values()}) == 1 for row in m["plain"].values())
        print(f"{name}: {len(m['plain'])} plain texts x {srcs}, {len(m['chat'])} chat texts; "
              f"all sources agree on {agree}/{len(m['plain'])}")
        for key, row in m["plain"].items():
            if len({tuple(v) for v in row.values()}) > 1:
                print(f"  {key}: " + "; ".join(f"{s}={v}" for s, v in row.items()))
    for n in notes:
        print("note:", n)


if __name__ == "__main__":
    main()
