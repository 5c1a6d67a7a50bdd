#!/usr/bin/env python3
"""Token-id fixtures for touchstone's tokenizer (src/tokenizer/): a set of
texts tokenised by every reference for every model, written to one JSON file
that `cargo test` compares our ids with (tests/tokenizer.rs).

    python goldens/recorders/make_tokenizer_fixtures.py OUT.json [--real-gguf PATH] [--gemma-gguf PATH] [--no-llamacpp]

Run it with the pinned recorder environment (requirements.txt;
`goldens/recorders/regen.sh` and `touchstone goldens regen` create it as
$TOUCHSTONE_CACHE/recorders-venv, default ~/.cache/touchstone/recorders-venv): transformers'
GGUF reader imports torch, and build_llamacpp.py needs the pinned cmake. The
committed fixture is
`tests/fixtures/tokenizer.json`; regenerate it with

    ~/.cache/touchstone/recorders-venv/bin/python goldens/recorders/make_tokenizer_fixtures.py tests/fixtures/tokenizer.json \
        --real-gguf ~/.cache/touchstone/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --gemma-gguf ~/.cache/touchstone/models/gemma-3-270m-q4_k_m.gguf

(the real model comes from ci/fetch_real_model.py; without --real-gguf its
section is left out and the Rust test reports it ignored; likewise the Gemma 3
270M GGUF, whose SentencePiece vocabulary the `spm` section records).

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
  sdist's ctypes bindings as llamacpp_lib.py loads them). Plain text:
  add_special=True, parse_special=True, as llama.cpp's own programs tokenise a
  prompt (`common_tokenize(ctx, prompt, true, true)`). Chat: llama.cpp has no
  Jinja in libllama, so the text HF rendered is tokenised with
  add_special=False, parse_special=True, as `apply_chat_template` encodes it
  (the template writes any BOS itself).

SentencePiece (`spm` section): GGUF vocabularies whose `tokenizer.ggml.model`
is `llama`, tokenised by llama.cpp only (plain text: add_special=True,
parse_special=True) and detokenised by it (`llama_detokenize`,
remove_special=False, unparse_special=True: every token written out, as
touchstone's report shows ids), on their own set of texts. Two tiny
vocabularies are written here and committed beside the fixture
(tests/fixtures/tokenizer-spm/: a few hundred pieces with scores and token
types, the 256 byte tokens, control/user-defined/unknown tokens; one with
`add_space_prefix` true and llama.cpp's defaults for BOS/EOS, one with it
false and BOS and EOS both added), and the real Gemma 3 vocabulary is read
from the model file given with --gemma-gguf.

gguf-py comes from the same sdist (gguf 0.19.0, not pip-installed), as for
convert_gguf.py; transformers needs it to read a GGUF's vocabulary.
"""

import argparse
import ctypes
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
        import llamacpp_lib

        self.lc, _ = llamacpp_lib.load_bindings(src, lib_dir)
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

    def detokenize(self, gguf, ids):
        """llama_detokenize(remove_special=False, unparse_special=True)."""
        lc = self.lc
        arr = (lc.llama_token * max(len(ids), 1))(*ids)
        cap = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        n = lc.llama_detokenize(self.vocab(gguf), arr, len(ids), buf, cap, False, True)
        assert 0 <= n <= cap, f"llama_detokenize failed ({n})"
        return buf.raw[:n].decode("utf-8")


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


# ---- SentencePiece vocabularies (`tokenizer.ggml.model` = "llama") ----

SPM_DIR = os.path.join(ROOT, "tests", "fixtures", "tokenizer-spm")
GEMMA = "gemma-3-270m-q4_k_m"

# Texts for the SentencePiece vocabularies: the byte-level set where it
# applies, and what SPM handles differently (spaces become U+2581 and may be
# prefixed, characters outside the vocabulary fall back to <0xXX> bytes,
# control and user-defined tokens are cut out of the text first).
SPM_TEXTS = {k: TEXTS[k] for k in (
    "ascii_prose", "python_code", "digits", "digits_mixed", "emoji_cjk", "combining_accents",
    "precomposed_accents", "leading_trailing_spaces", "tabs_crlf", "empty_line_run", "only_newlines",
    "spec_prompt", "golden_prompt", "real_spec_prompt")}
SPM_TEXTS.update({
    "empty": "",
    "one_space": " ",
    "space_runs": "a  b   c    d     e",
    "digits_odd": "12345 123",
    "repeated_letters": "aaaa aaa",
    "not_in_vocab": "q\u00f6\u00df \U00013000\U00013050 \ua66e \u0001\u007f",
    "literal_escape_char": "pre\u2581escaped \u2581 x",
    "gemma_chat": "<start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n",
    "specials_inline": "hi<end_of_turn>there <start_of_turn> x<s>y<unk>z</s> <bos>w<eos>",
    "special_at_end": "tail<end_of_turn>",
    "forced_control": "x<|im_end|>y \u2581<PRE>z",
    "user_defined_runs": "a\n\nb  c\n\n\nd",
})

UNKNOWN, CONTROL, USER_DEFINED, BYTE = 2, 3, 4, 6


def spm_tiny_pieces():
    """(text, score, type) of the tiny vocabulary, by id: special tokens,
    the 256 byte tokens, single characters (never a merge result, so their
    score does not matter), then merged pieces, each scored below the one
    before it so that earlier pieces merge first. A few pieces share a score
    (the digit pairs) to exercise the queue's tie-break (leftmost first).
    `q` is deliberately no token while `qu` is: SPM merges characters, not
    tokens. `<|im_end|>` and `\u2581<PRE>` are NORMAL here: llama.cpp turns
    them into control tokens by their text, which the `forced_control` text checks."""
    out = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL),
           ("<start_of_turn>", 0.0, CONTROL), ("<end_of_turn>", 0.0, CONTROL),
           ("\n\n", 0.0, USER_DEFINED), ("  ", 0.0, USER_DEFINED)]
    out += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    singles = ["\u2581"] + [c for c in "abcdefghijklmnoprstuvwxyz"] + [c for c in "ABCDEFGHIJKLMNOPRSTUVWXYZ"]
    singles += list("0123456789") + list(".,!?:;()=+-*'#<>_/\"") + ["\u00e9", "\u4e16", "\u754c"]
    out += [(c, -1000.0, 1) for c in singles]
    merged = [
        "\u2581t", "he", "\u2581the", "in", "er", "\u2581a", "on", "re", "\u2581s", "\u2581f", "ou", "\u2581w",
        "\u2581b", "\u2581The", "ck", "ick", "qu", "\u2581qu", "\u2581quick", "ro", "ow", "own", "\u2581br",
        "\u2581brown", "ox", "\u2581fox", "um", "mp", "ps", "\u2581j", "\u2581jumps", "ov", "\u2581ov",
        "\u2581over", "az", "zy", "\u2581l", "\u2581lazy", "og", "\u2581d", "\u2581dog", "\u2581i", "it", "'s",
        "\u2581it", "\u2581o", "cl", "ock", "\u2581n", "n'", "'t", "is", "\u2581is", "\u2581isn", "de", "def",
        "\u2581def", "fi", "\u2581fib", "ib", "(n", "):", "\u2581if", "tu", "rn", "urn", "\u2581return",
        "\u2581<", "\u2581-", "\u2581+", "\u2581=", "\u2581*", "\u25811", "\u25812", "3.", "14", "159", "000",
        "\u2581\u2581", "\u2581\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581\u2581\u2581\u2581\u2581", "ca",
        "f\u00e9", "\u2581caf\u00e9", "\u4e16\u754c", "aa", "le", "ad", "ing", "an", "nd", "\u2581and",
        "\u2581tr", "ail", "\u2581Go", "ld", "en", "\u2581Golden", "so", "rs", "\u2581ch", "ec", "\u2581check",
        "\u2581ev", "ery", "\u2581every", "st", "age", "\u2581stage", "\u2581x", "\u2581y", "us", "\u2581user",
        "\u2581model", "od", "el", "\u2581W", "ri", "te", "\u2581Wri", "po", "em", "\u2581poem", "\u2581hi",
        "hi", "\u2581there", "\u2581ta", "il", "<|im_end|>", "\u2581<PRE>", "pre", "\u2581pre", "esc", "ap", "ed",
    ]
    seen = {t for t, _, _ in out}
    n = 0
    for t in merged:
        assert t not in seen, f"duplicate piece {t!r}"
        seen.add(t)
        out.append((t, -float(n), 1))
        n += 1
    # The digit pairs tie: "12345" merges 12, 34 (leftmost first), not 23, 45.
    for t in ("12", "23", "34", "45", "56", "67", "78"):
        out.append((t, -500.0, 1))
    return out


def write_spm_tiny(path, add_space_prefix, explicit_specials):
    """A vocabulary-only GGUF (no tensors; llama.cpp still wants an
    architecture's hyper-parameters to load it). `explicit_specials`: BOS,
    EOS and UNK ids and add_bos/add_eos are written (EOS added too);
    otherwise llama.cpp's SPM defaults apply (BOS 1 added, EOS 2 not)."""
    import gguf

    pieces = spm_tiny_pieces()
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _, _ in pieces])
    w.add_token_scores([s for _, s, _ in pieces])
    w.add_token_types([k for _, _, k in pieces])
    w.add_add_space_prefix(add_space_prefix)
    if explicit_specials:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def record_spm(lcpp, gguf_path, shown_path):
    """llama.cpp's ids and text for every SPM text on one vocabulary.
    `decoded`: the text of all ids; `decoded_body`: of the ids between the
    BOS and the EOS llama.cpp added (the text itself, where llama.cpp
    round-trips it)."""
    vocab = lcpp.vocab(gguf_path)
    lc = lcpp.lc
    bos = lc.llama_vocab_bos(vocab) if lc.llama_vocab_get_add_bos(vocab) else None
    eos = lc.llama_vocab_eos(vocab) if lc.llama_vocab_get_add_eos(vocab) else None
    out = {"gguf": shown_path, "sha256": sha256(gguf_path), "bos": bos, "eos": eos,
           "ids": {}, "decoded": {}, "decoded_body": {}}
    for key, text in SPM_TEXTS.items():
        ids = lcpp.tokenize(gguf_path, text, True, True)
        out["ids"][key] = ids
        out["decoded"][key] = lcpp.detokenize(gguf_path, ids)
        body = ids[1:] if bos is not None and ids[:1] == [bos] else ids
        body = body[:-1] if eos is not None and body[-1:] == [eos] else body
        out["decoded_body"][key] = lcpp.detokenize(gguf_path, body)
    return out


def record_spm_section(lcpp, gemma, notes):
    os.makedirs(SPM_DIR, exist_ok=True)
    vocabularies = {}
    for name, prefix, explicit in (("spm-tiny-prefix", True, False), ("spm-tiny-no-prefix", False, True)):
        path = os.path.join(SPM_DIR, f"{name}.gguf")
        write_spm_tiny(path, prefix, explicit)
        vocabularies[name] = record_spm(lcpp, path, os.path.relpath(path, ROOT))
    if gemma:
        vocabularies[GEMMA] = record_spm(lcpp, os.path.abspath(gemma), f"$TOUCHSTONE_CACHE/models/{GEMMA}.gguf")
    else:
        notes.append(f"{GEMMA} not recorded (no --gemma-gguf): the test reports its SPM trials ignored")
    return {"texts": SPM_TEXTS, "vocabularies": vocabularies}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--real-gguf", help="the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (ci/fetch_real_model.py)")
    ap.add_argument("--gemma-gguf", help=f"the Gemma 3 270M Q4_K_M GGUF ({GEMMA}.gguf), for the `spm` section")
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
    spm = record_spm_section(lcpp, args.gemma_gguf, notes) if lcpp is not None else None
    if lcpp is None:
        notes.append("SentencePiece vocabularies not recorded (they are llama.cpp's)")

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
            "llamacpp_spm_decoded": "llama_detokenize(ids, remove_special=False, unparse_special=True)",
        },
        "texts": TEXTS,
        "notes": notes,
        "models": models,
        "pre_tokenizers": pre_tokenizers,
        "spm": spm,
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
    for name, v in (spm or {}).get("vocabularies", {}).items():
        same = [k for k in SPM_TEXTS if v["decoded_body"][k] == SPM_TEXTS[k]]
        print(f"spm {name}: {len(v['ids'])} texts; llama.cpp round-trips {len(same)}/{len(SPM_TEXTS)}")
    for n in notes:
        print("note:", n)


if __name__ == "__main__":
    main()
