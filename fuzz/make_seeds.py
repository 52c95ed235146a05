#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora, fuzz/corpus/<target>/, from the repository's
fixtures and configs and from small files made here: one valid input per shape of input
each reader accepts, small, so that mutations reach the parsers' branches quickly.
Run from anywhere: python3 fuzz/make_seeds.py (needs numpy)."""
import io
import json
import pathlib
import struct

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def npy(a):
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


f32 = np.arange(6, dtype="<f4").reshape(2, 3)
put("safetensors", "floats", safetensors([
    ("w", "F32", [2, 3], f32.tobytes()),
    ("b", "BF16", [3], (f32[0].view("<u4") >> 16).astype("<u2").tobytes()),
    ("h", "F16", [2], np.array([1.5, -2], "<f2").tobytes()),
    ("d", "F64", [1], np.array([3.25], "<f8").tobytes()),
], {"format": "pt"}))
put("safetensors", "ints", safetensors([("i", "I64", [2], np.array([1, -1], "<i8").tobytes()),
                                        ("u", "U8", [4], bytes(range(4))), ("e", "F32", [0], b"")]))

for name, a in {"i4": np.arange(5, dtype="<i4"), "i8_2d": np.arange(6, dtype="<i8").reshape(2, 3),
                "u2": np.arange(4, dtype="<u2"), "f4": np.ones(3, "<f4"), "u1_empty": np.zeros(0, "u1"),
                "scalar": np.array(7, "<i4")}.items():
    put("npy", name, npy(a))

tokens = np.array([5, 9, 2, 0, 7, 7, 1, 3, 0, 4, 8, 6, 0], "<u2")
put("corpus_bin", "u2", npy(tokens) + npy(np.array([4, 9, 13], "<u8")))
put("corpus_bin", "u1", npy(tokens.astype("u1")) + npy(np.array([13], "<u8")))
put("corpus_bin", "u4", npy(tokens.astype("<u4")) + npy(np.array([4, 13], "<u8")))

demo_toml = (ROOT / "configs" / "demo.toml").read_text()
put("train_state", "full", json.dumps({"step": 5, "seed": 0, "lr": 0.003, "data_cursor": {"samples_seen": 40},
                                       "config": demo_toml}, indent=2))
put("train_state", "minimal", json.dumps({"step": 5}))

for p in sorted((ROOT / "configs").glob("*.toml")):
    put("config_toml", p.stem, p.read_text())
put("config_toml", "parallel", "[parallelism]\ndp_shard = 2\nep = 2\ncp = 1\npp = 2\npipeline_schedule = \"dualpipev\"\n"
    "[training]\nsteps = 3\ncapacity_factor = 1.25\nfp8 = \"blockwise\"\n[model]\ninit = \"random\"\nconfig = \"c.json\"\n")

for p in sorted(ROOT.glob("tests/fixtures/**/*.json")) + sorted(ROOT.glob("configs/*/config.json")):
    j = json.loads(p.read_text())
    if isinstance(j, dict) and "model_type" in j:
        put("hf_config", f"{p.parent.name}_{p.stem}", p.read_text())

# Tokenizers: the fixtures' cut down to their first 300 vocabulary entries and the merges
# among those, so that one load takes microseconds.
for p in sorted((ROOT / "tests" / "fixtures" / "tokenizers").glob("*.json")):
    j = json.loads(p.read_text())
    if "model" not in j:
        continue
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < 300}
    merges = []
    for m in j["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    j["model"]["vocab"], j["model"]["merges"] = vocab, merges
    j["added_tokens"] = [t for t in j["added_tokens"] if t["id"] < 300] + [
        {"id": 300, "content": " <mask>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False}]
    text = json.dumps(j, ensure_ascii=False)
    put("tokenizer", p.stem, text)
    put("tokenizer", p.stem + "_text", text + "\n#text#\n" + "Mr. O'Neil's 3 <mask> tokens\r\n\t  \u00e9t\u00e9 <|endoftext|>")
