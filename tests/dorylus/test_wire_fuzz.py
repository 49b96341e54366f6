"""Forged and mutated wire payloads: the decoder raises only ``WireError`` and never over-allocates.

A seeded fuzz loop mutates valid requests (bit flips, byte writes, truncations, extensions, length-field
edits, header rewrites) and throws random bytes at ``wire.decode`` and at the op handler; targeted tests
pin each forged input found by hand (deep nesting, a 5000-digit integer, shape ``[0, 2**100]``, ``op`` as a
list, a huge length prefix at the worker).
"""

from __future__ import annotations

import io
import json
import random
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from lightning_dorylus import wire
from lightning_dorylus.executors import worker
from lightning_dorylus.ops import handlers


def _forge(meta: bytes | str, data_len: int = 0, *, total_len: int | None = None,
           header_len: int | None = None, reserved: tuple[int, int] = (0, 0)) -> bytes:
    """A payload with the given raw JSON header and ``data_len`` zero bytes after the aligned header."""
    raw = meta.encode() if isinstance(meta, str) else meta
    start = (wire.PREFIX_SIZE + len(raw) + wire.ALIGNMENT - 1) // wire.ALIGNMENT * wire.ALIGNMENT
    size = start + data_len
    prefix = struct.pack("<4sHHIIQ", wire.MAGIC, wire.VERSION, reserved[0],
                         len(raw) if header_len is None else header_len, reserved[1],
                         size if total_len is None else total_len)
    return prefix + raw + bytes(size - wire.PREFIX_SIZE - len(raw))


def _meta(header: dict, arrays: list[dict]) -> str:
    return json.dumps({"header": header, "arrays": arrays})


def _requests() -> list[bytes]:
    """Valid requests of every op shape the fuzzer starts from (small, so mutations hit every field)."""
    rng = np.random.default_rng(0)
    z, w = rng.standard_normal((6, 4)), rng.standard_normal((4, 3))
    h = np.maximum(z @ w, 0)
    return [
        wire.encode(handlers.request_header("apply_vertex.forward", {"activation": "relu"}, 0),
                    {"z": z, "weight": w, "bias": rng.standard_normal(3)}),
        wire.encode(handlers.request_header("apply_vertex.backward", {"activation": "relu",
                                                                      "has_bias": True}),
                    {"z": z.astype(np.float32), "weight": w.astype(np.float32), "h": h.astype(np.float32),
                     "grad_h": np.ones((6, 3), np.float32)}),
        wire.encode(handlers.request_header("apply_edge.forward", {"negative_slope": 0.2}),
                    {"alpha_src_e": rng.standard_normal((5, 2)), "alpha_dst": rng.standard_normal((3, 2)),
                     "dst_ptr": np.array([0, 2, 2, 5], np.int64)}),
        wire.encode({"ok": True, "nested": {"a": [1, 2.5, None, "s"]}},
                    {"empty": np.zeros((0, 7)), "scalar": np.array(3, np.int32), "mask": np.ones(4, bool)}),
        wire.encode({}, {}),
    ]


def _evil_json(rng: random.Random) -> str:
    """JSON text chosen to break a careless reader: wrong types, huge or negative numbers, deep nesting."""
    depth = rng.choice([2, 40, 3000])
    return rng.choice([
        "null", "true", "-1", "0", "1.5", "1e999", str(2**31), str(2**64), str(2**70), "7" * 5000,
        str(10**40),
        '""', json.dumps("x" * 2000), '"float64"', '"O"', '"<f8"', '"object"', "[]", "{}",
        "[" * depth + "]" * depth, '{"a": ' + "[" * depth + "]" * depth + "}",
        f"[0, {2**70}]", f"[{2**40}, {2**40}]", "[-1]", "[1.5]", "[true]", '["3"]', json.dumps([0] * 40),
        "[1, 2, 3]", '["apply_vertex.forward"]', '{"op": "apply_vertex.forward"}',
    ])


def _edit_meta(rng: random.Random, payload: bytes) -> bytes:
    """Replace one or two fields of the JSON header (array entries' or the caller's) and re-forge."""
    header_len = struct.unpack_from("<I", payload, 8)[0]
    meta = json.loads(payload[24:24 + header_len])
    targets: list[tuple[dict, str]] = [(meta, k) for k in ("header", "arrays")]
    targets += [(meta["header"], k) for k in [*meta["header"], "op", "attrs"]]
    if isinstance(meta["header"].get("attrs"), dict):
        targets += [(meta["header"]["attrs"], k) for k in ("activation", "has_bias", "negative_slope", "zzz")]
    for entry in meta["arrays"]:
        targets += [(entry, k) for k in ("name", "dtype", "shape", "offset")]
    replacements = {}
    for i in range(rng.randint(1, 2)):
        obj, key = rng.choice(targets)
        obj[key] = f"@@{i}@@"  # a placeholder: the hostile text may be more than json.dumps can write
        replacements[f'"@@{i}@@"'] = _evil_json(rng)
    raw = json.dumps(meta)
    for placeholder, text in replacements.items():
        raw = raw.replace(placeholder, text)
    return _forge(raw, len(payload) - _data_start(header_len))


def _mutate(rng: random.Random, payload: bytes) -> bytes:
    """One random corruption of ``payload``."""
    buf = bytearray(payload)
    kind = rng.randrange(9)
    if kind >= 7:  # structured: a field of the header gets a hostile value
        return _edit_meta(rng, payload)
    if kind == 0:  # flip 1-8 bits anywhere
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # overwrite a few bytes with random values
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 2:  # truncate
        del buf[rng.randrange(len(buf)):]
    elif kind == 3:  # extend with random bytes
        buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
    elif kind == 4:  # a length field (header_len u32 at 8, total_len u64 at 16) to an edge or random value
        if rng.random() < 0.5:
            value = rng.choice([0, 1, len(buf), len(buf) - 24, 2**32 - 1, rng.randrange(2**32)])
            struct.pack_into("<I", buf, 8, value)
        else:
            value = rng.choice([0, 24, len(buf) - 1, len(buf) + 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
            struct.pack_into("<Q", buf, 16, value)
    elif kind == 5:  # rewrite one JSON token of the header, keeping the payload's layout otherwise
        header_len = struct.unpack_from("<I", buf, 8)[0]
        text = bytes(buf[24:24 + header_len])
        token = rng.choice([b"[", b"{", b"]", b"}", b'"', b",", b":", b"-", b"0", b"9" * 30, b"1e999",
                            b"NaN", b"null", b"true", b"[0,1267650600228229401496703205376]", b"\\u0000"])
        pos = rng.randrange(len(text) + 1)
        text = text[:pos] + token + text[pos + rng.randint(0, 3):]
        return _forge(text, len(buf) - _data_start(header_len))
    else:  # random bytes behind a valid-looking prefix
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        return _forge(body, rng.randrange(0, 256))
    return bytes(buf)


def _data_start(header_len: int) -> int:
    return (wire.PREFIX_SIZE + header_len + wire.ALIGNMENT - 1) // wire.ALIGNMENT * wire.ALIGNMENT


def _only_wire_errors(fn: Callable[[bytes], object], inputs: list[bytes], allowed: tuple[type, ...]) -> int:
    """Run ``fn`` on every input; any exception outside ``allowed`` fails with the input that caused it."""
    rejected = 0
    for i, data in enumerate(inputs):
        try:
            fn(data)
        except allowed:
            rejected += 1
        except Exception as err:
            pytest.fail(f"input #{i} ({data[:120]!r}...) raised {type(err).__name__}: {err}")
    return rejected


def test_fuzz_decoder_raises_only_wire_error() -> None:
    rng = random.Random(1234)
    bases = _requests()
    inputs = [_mutate(rng, rng.choice(bases)) for _ in range(4000)]
    inputs += [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) for _ in range(300)]  # pure noise
    inputs += [wire.MAGIC + bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))) for _ in range(300)]
    rejected = _only_wire_errors(wire.decode, inputs, (wire.WireError,))
    assert rejected > len(inputs) // 2  # the mutations mostly break something; the rest decoded cleanly


def test_fuzz_handler_raises_only_clear_errors() -> None:
    """Mutated requests through the op handler: the wire's error, or the handler's ValueError naming it."""
    rng = random.Random(99)
    bases = _requests()[:3]
    inputs = [_mutate(rng, rng.choice(bases)) for _ in range(1500)]
    with np.errstate(all="ignore"):  # garbage floats may overflow; that is arithmetic, not a decoding error
        _only_wire_errors(handlers.handle, inputs, (ValueError,))  # WireError is a ValueError


def test_deeply_nested_header_is_rejected_before_json_recurses() -> None:
    deep = '{"header": {"a": ' + "[" * 100_000 + "]" * 100_000 + '}, "arrays": []}'
    with pytest.raises(wire.WireError, match="corrupt header: nesting depth 100002 exceeds the limit of 32"):
        wire.decode(_forge(deep))
    in_string = _meta({"s": "[" * 5000 + "\"{"}, [])  # brackets inside strings do not count
    assert wire.decode(_forge(in_string))[0] == {"s": "[" * 5000 + '"{'}
    with pytest.raises(wire.WireError, match=r"header is not JSON-serializable|nesting depth"):
        nested: list = []
        for _ in range(40):
            nested = [nested]
        wire.encode({"n": nested}, {})


def test_huge_integers_and_non_finite_constants_are_rejected() -> None:
    with pytest.raises(wire.WireError, match="an integer with 5000 digits exceeds the 24-digit limit"):
        wire.decode(_forge(_meta({"interval": 0}, []).replace("0", "7" * 5000)))
    with pytest.raises(wire.WireError, match="an integer with 101 digits"):
        wire.encode({"interval": 10**100}, {})  # the encoder refuses what the decoder would
    with pytest.raises(wire.WireError, match="corrupt header: NaN is not allowed"):
        wire.decode(_forge('{"header": {"x": NaN}, "arrays": []}'))
    with pytest.raises(wire.WireError, match="corrupt header: -Infinity is not allowed"):
        wire.decode(_forge('{"header": {"x": -Infinity}, "arrays": []}'))


def test_forged_shapes_are_rejected() -> None:
    entry = {"name": "a", "dtype": "float64", "shape": [0, 2**100], "offset": 0}
    with pytest.raises(wire.WireError, match="an integer with 31 digits exceeds the 24-digit limit"):
        wire.decode(_forge(_meta({}, [entry])))
    entry["shape"] = [0, 2**70, 3]  # digits within the limit: the byte-size bound catches it
    with pytest.raises(wire.WireError, match=r"array 'a' has shape \[0, 1180591620717411303424, 3\]: its "
                                             r"nonzero dimensions span \d+ bytes, more than the maximum"):
        wire.decode(_forge(_meta({}, [entry])))
    entry["shape"] = [1] * 33
    with pytest.raises(wire.WireError, match=r"invalid shape .*at most 32 ints"):
        wire.decode(_forge(_meta({}, [entry])))
    entry["shape"] = [2, True]
    with pytest.raises(wire.WireError, match=r"invalid shape \[2, True\]"):
        wire.decode(_forge(_meta({}, [entry])))
    entry["shape"], entry["dtype"] = [2], ["float64"]
    with pytest.raises(wire.WireError, match=r"has dtype \['float64'\] which is not allowed"):
        wire.decode(_forge(_meta({}, [entry]), 16))
    # A legitimate empty but wide array (an empty interval of a wide feature matrix) still round-trips.
    _, got = wire.decode(wire.encode({}, {"x": np.zeros((0, 100_000))}))
    assert got["x"].shape == (0, 100_000)


def test_offsets_must_match_the_layout_exactly() -> None:
    a = {"name": "a", "dtype": "float64", "shape": [2], "offset": 0}
    b = {"name": "b", "dtype": "float64", "shape": [2], "offset": 0}
    with pytest.raises(wire.WireError, match="array 'b' has offset 0 but the layout puts it at 64"):
        wire.decode(_forge(_meta({}, [a, b]), 80))  # b aliasing a
    b["offset"] = 128
    with pytest.raises(wire.WireError, match="array 'b' has offset 128 but the layout puts it at 64"):
        wire.decode(_forge(_meta({}, [a, b]), 144))  # a gap
    b["offset"] = 64
    assert set(wire.decode(_forge(_meta({}, [a, b]), 80))[1]) == {"a", "b"}
    with pytest.raises(wire.WireError, match=r"the arrays end at byte .* but total_len is"):
        wire.decode(_forge(_meta({}, [a, b]), 96))  # trailing bytes


def test_prefix_fields_are_bounded() -> None:
    good = wire.encode({"op": "x"}, {"a": np.ones(3)})
    with pytest.raises(wire.WireError, match="reserved fields must be 0, got 1 and 0"):
        wire.read_prefix(_forge(_meta({}, []), reserved=(1, 0)))
    with pytest.raises(wire.WireError, match=r"header_len \(2000000\) exceeds the 1048576-byte header limit"):
        wire.read_prefix(_forge(_meta({}, []), header_len=2_000_000, total_len=3_000_000))
    with pytest.raises(wire.WireError, match=r"payload of 18446744073709551615 bytes .* exceeds the maximum "
                                             r"message size 2147483648"):
        wire.read_prefix(good[:16] + struct.pack("<Q", 2**64 - 1))
    with pytest.raises(wire.WireError, match=f"payload of {len(good)} bytes .* maximum message size 100"):
        wire.decode(good, max_size=100)
    with pytest.raises(wire.WireError, match=r"total_len \(120\) is shorter than the aligned header end"):
        wire.read_prefix(good[:16] + struct.pack("<Q", 120))


def test_encoder_refuses_messages_over_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_MESSAGE_SIZE", 1000)
    with pytest.raises(wire.WireError, match=r"payload of 1128 bytes exceeds the maximum message size 1000 "
                                             r"\(wire.MAX_MESSAGE_SIZE\); send fewer rows"):
        wire.encode({}, {"a": np.zeros(125)})
    assert wire.encoded_size({}, {"a": np.zeros(125)}) == 1128  # planning still works


def test_handler_rejects_non_str_op_and_non_object_attrs() -> None:
    arrays = {"z": np.ones((2, 2)), "weight": np.ones((2, 2))}
    with pytest.raises(wire.WireError, match=r"request header 'op' must be a str naming one of .*got list"):
        handlers.handle(wire.encode({"op": ["apply_vertex.forward"]}, arrays))
    with pytest.raises(wire.WireError, match="request header 'attrs' must be a JSON object, got list"):
        handlers.handle(wire.encode({"op": "apply_vertex.forward", "attrs": [1]}, arrays))
    with pytest.raises(ValueError, match=r"unknown op \['x'\]: this handler has"):
        handlers.run_op(["x"], arrays)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"activation=\{'a': 1\} is not supported"):
        handlers.handle(wire.encode(handlers.request_header("apply_vertex.forward", {"activation": {"a": 1}}),
                                    arrays))
    header = handlers.error_header(["not", "a", "str"], ValueError("m" * 100_000))
    assert header["op"] is None and len(header["message"]) < 16_500
    wire.encode(header, {})  # an error reply to any request is itself a valid message


def test_worker_rejects_a_huge_length_prefix_before_allocating() -> None:
    forged = struct.pack("<4sHHIIQ", wire.MAGIC, wire.VERSION, 0, 10, 0, 2**62) + b"{}"
    tracemalloc.start()
    try:
        with pytest.raises(wire.WireError, match=r"payload of 4611686018427387904 bytes \(prefix total_len\) "
                                                 r"exceeds the maximum message size"):
            worker.read_message(io.BytesIO(forged))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing near the forged length was allocated
    good = wire.encode({"op": "x"}, {"a": np.ones(100)})
    with pytest.raises(wire.WireError, match="maximum message size 512"):
        worker.read_message(io.BytesIO(good), max_size=512)
    assert worker.read_message(io.BytesIO(good)) == bytearray(good)


def test_worker_answers_a_corrupt_prefix_with_an_error_and_stops() -> None:
    z, w = np.ones((2, 2)), np.eye(2)
    good = wire.encode(handlers.request_header("apply_vertex.forward"), {"z": z, "weight": w})
    forged = struct.pack("<4sHHIIQ", wire.MAGIC, wire.VERSION, 0, 10, 0, 2**62)
    out = io.BytesIO()
    worker.serve(io.BytesIO(good + forged + good), out)  # type: ignore[arg-type]
    stream = io.BytesIO(out.getvalue())
    replies = [wire.decode(m)[0] for m in iter(lambda: worker.read_message(stream), None)]
    assert replies[0]["ready"]
    assert replies[1] == handlers.response_header("apply_vertex.forward")  # with the op's fingerprint
    assert replies[2]["ok"] is False and replies[2]["error_type"] == "WireError"
    assert "exceeds the maximum message size" in replies[2]["message"]
    assert len(replies) == 3  # the request after the corrupt prefix is not read: the stream is out of sync


def test_worker_reads_every_request_into_one_reused_buffer_without_mixing_them() -> None:
    """Requests of growing and shrinking sizes share the worker's receive buffer; each answer is its own."""
    rng = np.random.default_rng(0)
    sizes = [6, 2, 9, 1]
    zs = [rng.standard_normal((n, 3)) for n in sizes]
    w = rng.standard_normal((3, 2))
    requests = b"".join(wire.encode(handlers.request_header("apply_vertex.forward"), {"z": z, "weight": w})
                        for z in zs)
    out = io.BytesIO()
    worker.serve(io.BytesIO(requests), out)  # type: ignore[arg-type]
    stream = io.BytesIO(out.getvalue())
    replies = [wire.decode(m) for m in iter(lambda: worker.read_message(stream), None)][1:]
    assert [h["ok"] for h, _ in replies] == [True] * len(zs)
    for z, (_, arrays) in zip(zs, replies):
        np.testing.assert_array_equal(arrays["h"], z @ w)
    buffer = worker.ReadBuffer()
    first = buffer.view(10)
    assert buffer.view(4).obj is first.obj and buffer.view(20).obj is not first.obj  # grows by a new one
