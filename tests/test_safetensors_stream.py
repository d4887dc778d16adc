"""Reading safetensors files (`jscenegen.model.safetensors_stream`): header limits, memory, byte order."""
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jscenegen.model import safetensors_stream
from jscenegen.model.safetensors_stream import MAX_HEADER_BYTES, raw_header, read_tensor
from jscenegen.model.weights import CheckpointFormatError


def test_a_header_length_past_the_file_end_or_the_librarys_limit_is_refused_before_reading(tmp_path):
    """The limit was 100 MiB (104,857,600), called the format's; the safetensors library refuses
    a header above 100,000,000 bytes ("header too large"). A length past the file's end was
    read short and blamed on the JSON."""
    assert MAX_HEADER_BYTES == 100_000_000
    f = tmp_path / "m.safetensors"
    f.write_bytes(struct.pack("<Q", 1000) + b'{"__metadata__": {}}')
    with pytest.raises(CheckpointFormatError, match=rf"^{f}: unreadable safetensors file \(header "
                       r"length past the end of the file: 8 \+ 1,000 header bytes, the file has "
                       r"28 \(truncated\?\)\)$"):
        raw_header(f)
    f.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(CheckpointFormatError, match=rf"^{f}: unreadable safetensors file \(a header "
                       r"of 100,000,001 bytes, above the safetensors library's limit of "
                       r"100,000,000\)$"):
        raw_header(f)
    f.write_bytes(struct.pack("<Q", 100_000_000) + b"{}")   # at the limit: only past the end
    with pytest.raises(CheckpointFormatError, match=r"header length past the end of the file"):
        raw_header(f)


def test_read_tensor_holds_the_tensor_once(tmp_path):
    """It read the bytes, then copied them into the array: twice the tensor at its peak."""
    f = tmp_path / "m.safetensors"
    w = np.arange(2 * 2**20, dtype=np.float32).reshape(2048, 1024)   # 8 MiB
    save_file({"w": w, "empty": np.zeros((0, 3), np.float32)}, str(f))
    raw_header(f)   # the header parsed (and cached) outside the measurement
    tracemalloc.start()
    try:
        got = read_tensor(f, "w")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, w)
    assert got.flags.writeable and got.flags.c_contiguous
    assert peak < 1.25 * w.nbytes, peak
    assert read_tensor(f, "empty").shape == (0, 3)


def test_tensors_are_decoded_little_endian_whatever_the_host(tmp_path, monkeypatch):
    """The format stores little-endian data; the array was read in the host's byte order. A
    big-endian host's native dtypes are simulated: the values must still come out right."""
    f = tmp_path / "m.safetensors"
    tensors = {"f32": np.array([1.5, -2.0, 3.25], np.float32),
               "f16": np.array([0.5, 65504.0], np.float16),
               "bf16": np.array([1.0, -3.0, 0.125], ml_dtypes.bfloat16)}
    save_file(tensors, str(f))
    real = safetensors_stream.np_dtype
    monkeypatch.setattr(safetensors_stream, "np_dtype", lambda name: real(name).newbyteorder(">"))
    for name, want in tensors.items():
        got = read_tensor(f, name)
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
