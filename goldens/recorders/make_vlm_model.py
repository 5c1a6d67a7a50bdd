#!/usr/bin/env python3
"""Build a tiny random-weight vision-language model (Qwen2-VL, Qwen3-VL, LLaVA-1.5 or LLaVA-NeXT) for the VLM goldens.

usage: make_vlm_model.py OUT_DIR --family qwen2-vl|qwen3-vl|llava|llava-next [--initializer-range R]
                         [--vision-initializer-range R]

--family llava and llava-next (issue 39, goldens/llava-tiny/ and
goldens/llava-next-tiny/) are built by llava_families.py (its docstring has
the configs, the tokenizer, the processor files and the weights; one
--initializer-range for the text model, the tower and the projector). The
rest of this docstring is about the Qwen-VL models (issue 24).

Writes a complete HF model folder into OUT_DIR: config.json,
generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the family's real chat template) and
preprocessor_config.json (the family's real image-processor settings).
Everything is built offline and deterministically: the same pinned packages
(requirements.txt) give byte-identical files. The tokenizer is
make_model.py's byte-level BPE (Qwen2's pre-tokenizer, vocabulary 512,
trained on make_model.py's corpus) with the family's real special tokens,
in the real models' order, at ids 0..13:
<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|>
<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|>
<|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>; the config's
image_token_id, video_token_id, vision_start_token_id and
vision_end_token_id are their ids here (asserted).

--family qwen2-vl (goldens/qwen2-vl-tiny/, Qwen2VLForConditionalGeneration):
  LM (Qwen2-VL's text model = Qwen2): hidden 64, FFN 128, 2 layers, 4 query
  heads on 2 KV heads, head_dim 16 (= hidden/heads: Qwen2VLAttention has no
  head_dim setting), QKV biases, no o_proj bias, RMSNorm eps 1e-6, untied LM
  head (as Qwen2-VL-7B), vocab 512, M-RoPE theta 1e6 with mrope_section
  [2, 3, 3] (sums to head_dim/2 = 8; the real [16, 24, 24] scaled down:
  frequencies 0-1 rotate by the temporal position, 2-4 by the height, 5-7 by
  the width). Vision tower: patch 14, temporal patch 2, 3 channels (Conv3d
  without bias, as HF), embed_dim 32, depth 2, 2 heads (head dim 16),
  mlp_ratio 2 (FFN 64), quick_gelu, LayerNorm eps 1e-6, 2-D vision RoPE
  theta 1e4, PatchMerger (ln_q, Linear 128->128, GELU, Linear 128->64:
  hidden_size 64 = the LM's hidden).
--family qwen3-vl (goldens/qwen3-vl-tiny/, Qwen3VLForConditionalGeneration):
  LM (Qwen3-VL's text model = Qwen3): hidden 64, FFN 128, 3 layers, 4 query
  heads on 2 KV heads, head_dim 16, q_norm/k_norm, no biases, tied LM head
  (as Qwen3-VL-2B/4B), vocab 512, interleaved M-RoPE theta 1e6 with
  mrope_section [4, 2, 2] (the real [24, 20, 20] scaled down to head_dim/2 =
  8: frequency j rotates by the height if j % 3 == 1 and j < 6, by the width
  if j % 3 == 2 and j < 6, else by the temporal position). Vision tower:
  patch 16, temporal patch 2, Conv3d with bias, hidden 32, depth 3, 2 heads
  (head dim 16), FFN 64, gelu_pytorch_tanh, learned position embeddings
  num_position_embeddings 64 (an 8x8 table, bilinearly interpolated with
  align_corners to the 14x20 grid of the test image: non-trivial weights),
  deepstack_visual_indexes [0, 1] (after vision blocks 0 and 1 a
  deepstack merger (postshuffle LayerNorm over 128) makes features that are
  added to the image rows after LM layers 0 and 1), merger (LayerNorm over
  32, Linear 128->128, GELU, Linear 128->64: out_hidden_size 64).

Weights: HF's own initialisation (normal, std = initializer_range) under
torch.manual_seed(make_model.WEIGHT_SEED) for every matrix, the Conv3d
kernels and the embeddings (the learned position table too; asserted none is
left constant); then, from a separate generator (make_model.BIAS_NORM_SEED),
every bias N(0, 0.1) (LayerNorm biases included, so an engine that drops one
fails) and every norm weight (RMSNorm and LayerNorm) 1 + N(0, 0.1).
Initializer ranges: INITIALIZER_RANGE_VLM (text) and
VISION_INITIALIZER_RANGE (vision), chosen by measurement (see their comment;
record_vlm.py prints per-stage standard deviations and attention sharpness).
"""
import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import (PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)

sys.dont_write_bytecode = True  # no __pycache__ in the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model import (BIAS_NORM_SEED, MAX_POSITIONS, QWEN2_PRETOKENIZE_REGEX, VOCAB, WEIGHT_SEED,  # noqa: E402
                        build_tokenizer)
import llava_families  # noqa: E402  (--family llava, llava-next)

# The special tokens of Qwen2-VL and Qwen3-VL (their added tokens
# 151643..151656, in that order; the tiny tokenizer puts them at 0..13).
VLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# The real chat templates. Qwen2-VL: Qwen/Qwen2-VL-*-Instruct's chat_template
# (a default system prompt when the first message is not a system one).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL: Qwen/Qwen3-VL-*-Instruct's chat_template (no default system
# prompt; tools and tool responses as Qwen3).
QWEN3_VL_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The real preprocessor_config.json of each family (Qwen2-VL-2B/7B-Instruct,
# Qwen3-VL-2B/4B/8B-Instruct), written key for key, plus the defaults of the
# pinned Qwen2VLImageProcessorPil made explicit (resample 3 = bicubic,
# rescale 1/255, normalise, convert to RGB), so an engine reads every setting
# from the file. Qwen2-VL spells the pixel bounds min_pixels/max_pixels (the
# processor maps them to size.shortest_edge/longest_edge), Qwen3-VL `size`.
COMMON_PREPROCESSOR = {"do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                       "do_normalize": True, "do_convert_rgb": True, "temporal_patch_size": 2, "merge_size": 2}
PREPROCESSOR = {
    "qwen2-vl": {**COMMON_PREPROCESSOR, "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711],
                 "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"},
    "qwen3-vl": {**COMMON_PREPROCESSOR, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                 "patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                 "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"},
}

# Std of HF's normal initialisation. Text: qwen2-tiny's 0.15 (make_model.py
# says why). Vision: chosen by measurement with record_vlm.py's summary
# (vision attention row max x n_keys, per-stage std) on the committed images;
# see the README section "Vision-language models".
INITIALIZER_RANGE_VLM = 0.15
VISION_INITIALIZER_RANGE = 0.15


def text_config(family, eos_id, r):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, hidden_act="silu", max_position_embeddings=MAX_POSITIONS,
                  rms_norm_eps=1e-6, initializer_range=r, bos_token_id=None, eos_token_id=eos_id,
                  pad_token_id=eos_id, dtype="float32")
    if family == "qwen2-vl":
        return dict(common, num_hidden_layers=2, use_sliding_window=False, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0})
    return dict(common, num_hidden_layers=3, head_dim=16, attention_bias=False, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                 "rope_theta": 1000000.0})


def vision_config(family, r):
    if family == "qwen2-vl":
        return dict(depth=2, embed_dim=32, hidden_size=64, hidden_act="quick_gelu", mlp_ratio=2, num_heads=2,
                    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=r)
    return dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
                in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                num_position_embeddings=64, deepstack_visual_indexes=[0, 1], initializer_range=r)


def build_config(family, ids, r_text, r_vision):
    cls = Qwen2VLConfig if family == "qwen2-vl" else Qwen3VLConfig
    return cls(text_config=text_config(family, ids["<|endoftext|>"], r_text),
               vision_config=vision_config(family, r_vision),
               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               tie_word_embeddings=family == "qwen3-vl", bos_token_id=None, eos_token_id=ids["<|endoftext|>"],
               pad_token_id=ids["<|endoftext|>"], dtype="float32")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--family", choices=["qwen2-vl", "qwen3-vl", *llava_families.FAMILIES], required=True)
    ap.add_argument("--initializer-range", type=float, default=None,
                    help=f"text model (default {INITIALIZER_RANGE_VLM}; LLaVA: every weight, default "
                         f"{llava_families.INITIALIZER_RANGE}; for sweeps only)")
    ap.add_argument("--vision-initializer-range", type=float, default=VISION_INITIALIZER_RANGE,
                    help=f"vision tower (default {VISION_INITIALIZER_RANGE}; Qwen-VL only; for sweeps only)")
    args = ap.parse_args()
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.utils.logging.disable_progress_bar()
    if args.family in llava_families.FAMILIES:
        r = llava_families.INITIALIZER_RANGE if args.initializer_range is None else args.initializer_range
        made = llava_families.build(args.family, out, r)
        print(json.dumps({"out": out, "family": args.family, "files": sorted(os.listdir(out)), **made,
                          **{f"{k}_sha256": sha256(os.path.join(out, f)) for k, f in (
                              ("model", "model.safetensors"), ("tokenizer", "tokenizer.json"),
                              ("config", "config.json"), ("preprocessor", "preprocessor_config.json"),
                              ("processor", "processor_config.json"))}}))
        return
    if args.initializer_range is None:
        args.initializer_range = INITIALIZER_RANGE_VLM

    tok = build_tokenizer(QWEN2_PRETOKENIZE_REGEX, VLM_SPECIALS)
    n = tok.get_vocab_size()
    assert n <= VOCAB, n
    ids = {s: tok.token_to_id(s) for s in VLM_SPECIALS}
    assert list(ids.values()) == list(range(len(VLM_SPECIALS))), ids
    # The image placeholder must stay three tokens (no merge across specials).
    ph = tok.encode("<|vision_start|><|image_pad|><|vision_end|>").ids
    assert ph == [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"]], ph
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=MAX_POSITIONS)
    fast.chat_template = QWEN2_VL_CHAT_TEMPLATE if args.family == "qwen2-vl" else QWEN3_VL_CHAT_TEMPLATE
    fast.save_pretrained(out)
    # The chat template belongs in tokenizer_config.json (where the real
    # models and the other tiny models' readers look), not in a separate
    # chat_template.jinja: move it there if this transformers wrote one.
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    jinja = os.path.join(out, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            tc["chat_template"] = f.read()
        os.remove(jinja)
    assert tc.get("chat_template") == fast.chat_template, "chat template not saved"
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR[args.family], f, indent=2, sort_keys=True)
        f.write("\n")

    torch.manual_seed(WEIGHT_SEED)
    cls = Qwen2VLForConditionalGeneration if args.family == "qwen2-vl" else Qwen3VLForConditionalGeneration
    cfg = build_config(args.family, ids, args.initializer_range, args.vision_initializer_range)
    model = cls(cfg).to(torch.float32).eval()
    # Biases and norm weights from their own generator (see the docstring).
    norm_types = (torch.nn.LayerNorm,)
    g = torch.Generator().manual_seed(BIAS_NORM_SEED)
    norm_params = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, norm_types) or type(mod).__name__.endswith("RMSNorm"):
            norm_params.add(f"{mname}.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():  # fixed module order
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name in norm_params:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
    # No parameter may be left constant (HF initialises biases to 0 and norm
    # weights to 1; every other tensor must have been drawn by HF's init).
    for name, p in model.named_parameters():
        assert p.numel() < 2 or float(p.detach().std()) > 1e-3, f"{name} is (nearly) constant"
    tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == (args.family == "qwen3-vl"), f"LM head tied={tied}"
    lm = model.model.language_model
    vis = model.model.visual
    if args.family == "qwen2-vl":
        a = lm.layers[0].self_attn
        assert a.q_proj.bias is not None and a.o_proj.bias is None and a.head_dim == 16
        assert vis.patch_embed.proj.bias is None
        assert vis.merger.mlp[0].in_features == 128 and vis.merger.mlp[2].out_features == 64
    else:
        a = lm.layers[0].self_attn
        assert a.q_proj.bias is None and a.head_dim == 16 and a.q_norm.weight.shape == (16,)
        assert vis.patch_embed.proj.bias is not None and vis.pos_embed.weight.shape == (64, 32)
        assert vis.num_grid_per_side == 8 and list(vis.deepstack_visual_indexes) == [0, 1]
        assert len(vis.deepstack_merger_list) == 2 and vis.deepstack_merger_list[0].use_postshuffle_norm
    model.config.text_config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    if tied:
        from safetensors import safe_open
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys(), "tied LM head must not be saved"
    files = sorted(os.listdir(out))
    print(json.dumps({
        "out": out, "family": args.family, "files": files, "tokenizer_vocab": n,
        "special_ids": ids, "initializer_range": args.initializer_range,
        "vision_initializer_range": args.vision_initializer_range,
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_sha256": sha256(os.path.join(out, "model.safetensors")),
        "tokenizer_sha256": sha256(os.path.join(out, "tokenizer.json")),
        "config_sha256": sha256(os.path.join(out, "config.json")),
    }))


if __name__ == "__main__":
    sys.exit(main())
