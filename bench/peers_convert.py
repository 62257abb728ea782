"""bench/peers.py's helpers: the random checkpoint, each peer's offline conversion from it (into the bench's
temp dir) and each engine's greedy loop, `gen(prompts int [B, T], n) -> tokens int [B, n]`, never stopping
early, and `logits(prompts) -> [B, V]` float32, the logits after each prompt's last token (the int8 rows'
error against fp32). Imported from beside it; each engine's imports happen in its own worker process.

The ONNX export (ONNX Runtime and OpenVINO read the same file) is GPT-2's forward written out in torch
over the checkpoint's own tensors, with the KV cache as inputs and outputs (past_i [B, H, S, K] in,
present_i [B, H, S + T, K] out, concatenated as transformers' eager cache does), last-position logits out.
The GGUF is written with the `gguf` package as llama.cpp's convert_hf_to_gguf.py writes GPT-2 (its tensor
names, Conv1D weights transposed, the tokenizer's tokens and merges; q8_0 for every 2-D weight but wpe).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def checkpoint(path: Path) -> None:
    """A random gpt2-small GPT2LMHeadModel (every parameter random) saved with save_pretrained, with tokenizer
    files built from gpt2_jax's BPE ranks, as `convert --to-hf` writes them (CTranslate2 and the GGUF need a
    vocabulary; nothing downloads)."""
    import torch
    import transformers

    from gpt2_jax.checkpoints.hf_tokenizer import write_tokenizer
    from gpt2_jax.tokenizer import tokenizer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    with torch.no_grad():  # as tests/reference.py does: LayerNorms and biases random too (lm_head is wte, tied)
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.2 * torch.randn_like(p)
                if "ln_" in name and name.endswith("weight")
                else 0.1 * torch.randn_like(p)
            )
    model.save_pretrained(path)
    write_tokenizer(Path(path), tokenizer(), model.config.n_positions)


class _Step:
    """GPT-2 over the HF checkpoint's tensors as a torch module for torch.onnx.export: (ids, *past) ->
    (last logits [B, V], *present)."""

    @staticmethod
    def build(hf):
        import torch
        import torch.nn.functional as F

        c = hf.config
        H, D = c.n_head, c.n_embd
        t = hf.transformer

        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.t = t  # its tensors as the module's own parameters, not captured constants

            def forward(self, ids, *past):
                B, T = ids.shape
                S = past[0].shape[2]
                x = t.wte.weight[ids] + t.wpe.weight[torch.arange(T) + S]
                mask = torch.arange(S + T)[None, :] > (torch.arange(T) + S)[:, None]
                presents = []
                for i, block in enumerate(t.h):
                    h = F.layer_norm(x, (D,), block.ln_1.weight, block.ln_1.bias, c.layer_norm_epsilon)
                    q, k, v = (h @ block.attn.c_attn.weight + block.attn.c_attn.bias).split(D, -1)
                    q, k, v = (a.reshape(B, T, H, D // H).transpose(1, 2) for a in (q, k, v))
                    k, v = torch.cat([past[2 * i], k], 2), torch.cat([past[2 * i + 1], v], 2)
                    presents += [k, v]
                    att = (q @ k.transpose(2, 3)) / (D // H) ** 0.5
                    att = att.masked_fill(mask, float("-inf")).softmax(-1)
                    y = (att @ v).transpose(1, 2).reshape(B, T, D)
                    x = x + y @ block.attn.c_proj.weight + block.attn.c_proj.bias
                    h = F.layer_norm(x, (D,), block.ln_2.weight, block.ln_2.bias, c.layer_norm_epsilon)
                    h = F.gelu(h @ block.mlp.c_fc.weight + block.mlp.c_fc.bias, approximate="tanh")
                    x = x + h @ block.mlp.c_proj.weight + block.mlp.c_proj.bias
                x = F.layer_norm(x[:, -1], (D,), t.ln_f.weight, t.ln_f.bias, c.layer_norm_epsilon)
                return (x @ t.wte.weight.T, *presents)

        return Step().eval().requires_grad_(False)


def onnx_model(ckpt: Path, work: Path, int8: bool) -> Path:
    """The checkpoint as ONNX with the KV cache (fp32), or that file through quantize_dynamic (int8 MatMuls)."""
    out = work / "onnx" / ("model_int8.onnx" if int8 else "model.onnx")
    if out.exists():
        return out
    fp32 = work / "onnx" / "model.onnx"
    if not fp32.exists():
        import torch
        import transformers

        hf = transformers.GPT2LMHeadModel.from_pretrained(ckpt).eval()
        c = hf.config
        L, H, K = c.n_layer, c.n_head, c.n_embd // c.n_head
        names = [f"past_{i}" for i in range(2 * L)]
        past = [torch.zeros(1, H, 3, K) for _ in names]
        fp32.parent.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            torch.onnx.export(
                _Step.build(hf), (torch.zeros(1, 2, dtype=torch.int64), *past), str(fp32), dynamo=False,
                input_names=["ids", *names], output_names=["logits", *[f"present_{i}" for i in range(2 * L)]],
                dynamic_axes={"ids": {0: "B", 1: "T"}, "logits": {0: "B"},
                              **{n: {0: "B", 2: "S"} for n in names},
                              **{f"present_{i}": {0: "B", 2: "S_T"} for i in range(2 * L)}},
                opset_version=17,
            )  # fmt: skip
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
    return out


def _past(B: int, L: int, H: int, K: int) -> list[np.ndarray]:
    return [np.zeros((B, H, 0, K), np.float32) for _ in range(2 * L)]


def _shape(ckpt: Path) -> tuple[int, int, int]:
    c = json.loads((ckpt / "config.json").read_text())
    return c["n_layer"], c["n_head"], c["n_embd"] // c["n_head"]


def engine_gpt2_jax(ckpt: Path, work: Path, threads: int, precision: str):
    import jax

    import gpt2_jax
    from gpt2_jax import kernels
    from gpt2_jax.kernels.ffi import int8_isa

    dtype = {"fp32": "float32", "fp32-packed": "float32-packed"}.get(precision, precision)
    params, config = gpt2_jax.load(ckpt, dtype=dtype)

    def gen(prompts, n):
        out = gpt2_jax.generate(params, config, prompts.tolist(), jax.random.key(0), max_new_tokens=n, eos_id=None,
                                temperature=0.0)  # fmt: skip
        return np.asarray(out.tokens)

    def logits(prompts):
        return np.asarray(gpt2_jax.forward(params, prompts, config))[:, -1]

    isa = os.environ.get("GPT2_JAX_ROWDOT_ISA")
    rows = {"int8": "int16-rounded activations",
            "w8a8": "activations rounded to bytes per row (c_attn's to int16)"}.get(precision)  # fmt: skip
    q = f", int8 weights (rowdot_int8, {int8_isa()}), {rows}" if rows else ""
    info = f"jax {jax.__version__}, kernels {kernels.available()}" + (f", forced {isa}" if isa else "") + q
    return gen, info, logits


def engine_transformers(ckpt: Path, work: Path, threads: int, precision: str):
    import torch
    import transformers

    torch.set_num_threads(threads)
    hf = transformers.GPT2LMHeadModel.from_pretrained(ckpt).eval()

    def gen(prompts, n):
        ids = torch.as_tensor(prompts)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=50256)  # fmt: skip
        return out[:, ids.shape[1] :].numpy()

    def logits(prompts):
        with torch.no_grad():
            return hf(torch.as_tensor(prompts)).logits[:, -1].numpy()

    return gen, f"transformers {transformers.__version__}, torch {torch.__version__}", logits


def engine_onnxruntime(ckpt: Path, work: Path, threads: int, precision: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    path = onnx_model(ckpt, work, precision == "int8")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    L, H, K = _shape(ckpt)
    names = [f"past_{i}" for i in range(2 * L)]
    value = ort.OrtValue.ortvalue_from_numpy

    def gen(prompts, n):
        feeds = {
            "ids": value(prompts.astype(np.int64)),
            **{k: value(a) for k, a in zip(names, _past(len(prompts), L, H, K))},
        }
        tokens = []
        for _ in range(n):
            out = sess.run_with_ort_values(None, feeds)  # the presents stay OrtValues, fed straight back
            tokens.append(out[0].numpy().argmax(-1))
            feeds = {"ids": value(tokens[-1][:, None].astype(np.int64)), **dict(zip(names, out[1:]))}
        return np.stack(tokens, 1)

    def logits(prompts):
        feeds = {"ids": prompts.astype(np.int64), **dict(zip(names, _past(len(prompts), L, H, K)))}
        return sess.run(None, feeds)[0]

    q = ", quantize_dynamic QInt8 MatMul weights, dynamic int8 activations" if precision == "int8" else ""
    return gen, f"onnxruntime {ort.__version__}, torch.onnx export with KV cache{q}", logits


def engine_openvino(ckpt: Path, work: Path, threads: int, precision: str):
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx_model(ckpt, work, False)))
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    note = ""
    if precision == "int8":
        import nncf

        model = nncf.compress_weights(model)  # INT8_ASYM per output channel, weight-only
        note = f", nncf {nncf.__version__} compress_weights int8"
    else:
        config["INFERENCE_PRECISION_HINT"] = "f32"  # this host has bf16 (AMX): OpenVINO's default would be bf16
    compiled = core.compile_model(model, "CPU", config)
    L, H, K = _shape(ckpt)
    names = [f"past_{i}" for i in range(2 * L)]
    requests = [compiled.create_infer_request(), compiled.create_infer_request()]  # in turns: outputs feed the other

    def gen(prompts, n):
        feeds = {"ids": prompts.astype(np.int64), **dict(zip(names, _past(len(prompts), L, H, K)))}
        tokens = []
        for s in range(n):
            out = requests[s % 2].infer(feeds, share_inputs=True, share_outputs=True).to_tuple()
            tokens.append(out[0].argmax(-1))
            feeds = {"ids": tokens[-1][:, None].astype(np.int64), **dict(zip(names, out[1:]))}
        return np.stack(tokens, 1)

    def logits(prompts):
        feeds = {"ids": prompts.astype(np.int64), **dict(zip(names, _past(len(prompts), L, H, K)))}
        return np.array(requests[0].infer(feeds).to_tuple()[0])

    hint = compiled.get_property("INFERENCE_PRECISION_HINT")
    hint = hint.get_type_name() if hasattr(hint, "get_type_name") else hint
    return gen, f"openvino {ov.__version__.split('-')[0]}, ONNX with KV cache{note}, inference precision {hint}", logits


def gguf_model(ckpt: Path, work: Path, q8: bool) -> Path:
    """The checkpoint as GGUF (f32, or q8_0 for every 2-D weight but position_embd), as convert_hf_to_gguf.py
    writes GPT-2."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import GPT2TokenizerFast

    out = work / ("gpt2-q8_0.gguf" if q8 else "gpt2-f32.gguf")
    c = json.loads((ckpt / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "gpt2")
    w.add_block_count(c["n_layer"])
    w.add_context_length(c["n_ctx"] if "n_ctx" in c else c["n_positions"])
    w.add_embedding_length(c["n_embd"])
    w.add_feed_forward_length(4 * c["n_embd"])
    w.add_head_count(c["n_head"])
    w.add_layer_norm_eps(c["layer_norm_epsilon"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    tok = GPT2TokenizerFast.from_pretrained(ckpt)
    reverse = {i: t for t, i in tok.vocab.items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([reverse[i] for i in range(c["vocab_size"])])
    w.add_token_types([gguf.TokenType.CONTROL if i == 50256 else gguf.TokenType.NORMAL for i in range(c["vocab_size"])])
    gguf.SpecialVocab(ckpt, load_merges=True).add_to_gguf(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, c["n_layer"])
    for name, data in load_file(ckpt / "model.safetensors").items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        name = name.removeprefix("transformer.")
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = np.ascontiguousarray(data.T)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if q8 and data.ndim == 2 and not new.startswith("position_embd"):
            w.add_tensor(new, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(new, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_quiet = None


def engine_llama_cpp(ckpt: Path, work: Path, threads: int, precision: str):
    import llama_cpp as lc

    path = gguf_model(ckpt, work, precision == "q8_0")
    lc.llama_backend_init()
    global _quiet  # the callback must outlive the call
    _quiet = lc.llama_log_callback(lambda *a: None)
    lc.llama_log_set(_quiet, None)
    mparams = lc.llama_model_default_params()
    # GPT2_JAX_PEERS_LLAMA_EXTRA_BUFTS=0: without llama.cpp's repacked/AMX weight buffers (its q8_0 decode
    # segfaulted with them on a Xeon with AMX, llama-cpp-python 0.3.36 built from source there)
    mparams.use_extra_bufts = os.environ.get("GPT2_JAX_PEERS_LLAMA_EXTRA_BUFTS", "1") != "0"
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    params = lc.llama_context_default_params()
    # 640 positions per sequence: peers.py's 512-token prefill prompt and its new token fit one sequence
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8 * 640, 512, 512, 8
    params.n_threads = params.n_threads_batch = threads
    if precision == "f32":  # an f32 KV cache too (llama.cpp's default is f16; q8_0 keeps that default)
        params.type_k = params.type_v = lc.GGML_TYPE_F32
    ctx = lc.llama_init_from_model(model, params)
    V = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, 8)

    def decode(rows: list[list[int]], start: int) -> np.ndarray:
        """One llama_decode of each row's tokens (sequence b at positions start..) -> its last logits [B, V]."""
        i = 0
        for b, row in enumerate(rows):
            for j, token in enumerate(row):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = (
                    token,
                    start + j,
                    1,
                    j == len(row) - 1,
                )
                batch.seq_id[i][0] = b
                i += 1
        batch.n_tokens = i
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(rows), V))

    def gen(prompts, n):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        tokens = [decode(prompts.tolist(), 0).argmax(-1)]
        for s in range(1, n):
            tokens.append(decode([[int(t)] for t in tokens[-1]], prompts.shape[1] + s - 1).argmax(-1))
        return np.stack(tokens, 1)

    def logits(prompts):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        return decode(prompts.tolist(), 0).copy()

    kv = "f32" if precision == "f32" else "f16"
    return gen, f"llama-cpp-python {lc.__version__}, GGUF written with gguf's GGUFWriter, {kv} KV cache", logits


def engine_ctranslate2(ckpt: Path, work: Path, threads: int, precision: str):
    import ctranslate2

    out = work / f"ct2-{precision}"
    ctranslate2.converters.TransformersConverter(str(ckpt)).convert(str(out), quantization=precision, force=True)
    generator = ctranslate2.Generator(str(out), device="cpu", compute_type=precision, intra_threads=threads,
                                      inter_threads=1)  # fmt: skip
    vocab = json.loads((out / "vocabulary.json").read_text())
    index = {t: i for i, t in enumerate(vocab)}

    def gen(prompts, n):
        start = [[vocab[t] for t in row] for row in prompts.tolist()]
        results = generator.generate_batch(start, max_length=n, min_length=n, sampling_topk=1,
                                           include_prompt_in_result=False)  # fmt: skip
        return np.array([[index[t] for t in r.sequences[0]] for r in results])

    def logits(prompts):
        out = generator.forward_batch([[vocab[t] for t in row] for row in prompts.tolist()])
        return np.asarray(out, np.float32)[:, -1]  # a CPU StorageView is an array (its __array_interface__)

    return gen, f"ctranslate2 {ctranslate2.__version__}, TransformersConverter quantization={precision}", logits


ENGINES = {
    "gpt2_jax": engine_gpt2_jax,
    "transformers": engine_transformers,
    "onnxruntime": engine_onnxruntime,
    "openvino": engine_openvino,
    "llama.cpp": engine_llama_cpp,
    "ctranslate2": engine_ctranslate2,
}
