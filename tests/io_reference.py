#!/usr/bin/env python3
"""Reads and writes .npy and safetensors files with numpy alone, for test_io.

An implementation independent of moetrain's, so test_io can check that numpy reads
what moetrain writes and that moetrain reads what numpy writes.

  io_reference.py npy-describe FILE.npy OUT.json
      {"descr", "shape", "fortran_order", "values"} of the array as np.load sees it
  io_reference.py npy-write DIR
      writes arrays with np.save / np.lib.format into DIR, and DIR/manifest.json
      listing each file's descr, shape, fortran_order and values (C order)
  io_reference.py st-describe FILE.safetensors OUT.json
      {"__metadata__": {...}, name: {"dtype", "shape", "values"}} with float values
      for F32/F64/F16/BF16 tensors and integer values for integer tensors
"""
import json
import struct
import sys

import numpy as np


def describe(a):
    return {
        "descr": a.dtype.str,
        "shape": list(a.shape),
        "fortran_order": bool(a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous),
        "values": a.ravel(order="C").tolist(),
    }


def npy_describe(path, out):
    with open(out, "w") as f:
        json.dump(describe(np.load(path)), f)


def npy_write(folder):
    rng = np.random.default_rng(7)
    arrays = {
        "i32_2d.npy": rng.integers(-2**31, 2**31 - 1, size=(3, 5), dtype=np.int32),
        "i64_1d.npy": rng.integers(-2**62, 2**62, size=(7,), dtype=np.int64),
        "u16_2d.npy": rng.integers(0, 2**16, size=(4, 2), dtype=np.uint16),
        "u8_1d.npy": np.arange(250, 256, dtype=np.uint8),
        "f32_3d.npy": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "f64_0d.npy": np.array(-1.25e-300, dtype=np.float64),
        "i32_empty.npy": np.zeros((0, 3), dtype=np.int32),
    }
    manifest = []
    for name, a in arrays.items():
        np.save(f"{folder}/{name}", a)
        manifest.append({"file": name, **describe(a)})
    # Format 2.0 (4-byte header length), as numpy writes for very large headers.
    a = np.arange(6, dtype=np.int64).reshape(2, 3) - 3
    with open(f"{folder}/v2_i64.npy", "wb") as f:
        np.lib.format.write_array(f, a, version=(2, 0))
    manifest.append({"file": "v2_i64.npy", **describe(a)})
    # Column-major: moetrain must refuse it rather than read it transposed.
    a = np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3))
    np.save(f"{folder}/fortran.npy", a)
    manifest.append({"file": "fortran.npy", **describe(a)})
    with open(f"{folder}/manifest.json", "w") as f:
        json.dump(manifest, f)


NUMPY_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


def st_describe(path, out):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    result = {"__metadata__": header.pop("__metadata__", {})}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        chunk = data[begin:end]
        if info["dtype"] == "BF16":
            # bf16 is the top half of a float32.
            bits = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
            values = bits.view(np.float32)
        else:
            values = np.frombuffer(chunk, dtype=NUMPY_DTYPES[info["dtype"]])
        result[name] = {"dtype": info["dtype"], "shape": info["shape"], "values": values.tolist()}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"npy-describe": npy_describe, "npy-write": npy_write, "st-describe": st_describe}[command](*args)
