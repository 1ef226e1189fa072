"""policy/delta.py: exact round trips, and hostile blobs refused with a reason before any large allocation."""

from __future__ import annotations

import math
import resource
import struct

import numpy as np
import pytest
import torch
import zstandard

from echo2swarm.policy import delta
from echo2swarm.policy.delta import (
    BITMAP,
    DELTA_FORMAT,
    GAPS_CHANGED,
    GAPS_UNCHANGED,
    ZSTD_LEVEL,
    DeltaError,
    apply_delta,
    apply_delta_bits,
    decode_varints,
    encode_delta,
    encode_varints,
    max_delta_bytes,
    tensor_bits,
    tensor_sha256,
)
from echo2swarm.policy.orders import RUN_ITEMS, TensorOrder, advance, visit_orders

pytestmark = pytest.mark.timeout(120)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and np.array_equal(tensor_bits(a[k]), tensor_bits(b[k])) for k in a)


def nudged(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`t` with about `fraction` of its items moved by one ulp (either way), as training at a small lr does."""
    g = torch.Generator().manual_seed(seed)
    bits = tensor_bits(t).copy()
    pick = torch.rand(t.numel(), generator=g).numpy() < fraction
    step = np.where(torch.rand(t.numel(), generator=g).numpy() < 0.5, 1, -1).astype(bits.dtype)
    bits[pick] += step[pick]
    return torch.from_numpy(bits.view(np.uint8)).view(t.dtype).reshape(t.shape)


def model_like(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(49, 64, generator=g) * 0.02).to(dtype),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(128, 64, generator=g) * 0.02).to(dtype),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=dtype),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(4, 16, 64, generator=g) * 0.02).to(dtype),
        "scalar": torch.tensor(0.5, dtype=dtype),
        "empty": torch.zeros(0, 7, dtype=dtype),
    }


def round_trip(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> bytes:
    blob = encode_delta(base, new)
    before = {k: tensor_bits(v).copy() for k, v in base.items()}
    rebuilt = apply_delta(base, blob)
    assert same_bits(rebuilt, new)
    assert all(np.array_equal(before[k], tensor_bits(base[k])) for k in base), "apply_delta modified the base"
    assert all(tensor_sha256(rebuilt[k]) == tensor_sha256(new[k]) for k in new)
    return blob


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8])
def test_round_trip_sparse_changes_every_dtype(dtype):
    base = model_like(dtype)
    new = {k: nudged(v, 0.02, seed=i) for i, (k, v) in enumerate(base.items())}
    assert not same_bits(base, new)
    round_trip(base, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_none_changed_and_all_changed(dtype):
    base = model_like(dtype)
    blob = round_trip(base, {k: v.clone() for k, v in base.items()})
    assert len(blob) < 400    # the tensor table and the class table (each class of the base: its size, no changes)
    everything = {k: nudged(v, 1.0, seed=3) for k, v in base.items()}
    assert all((tensor_bits(everything[k]) != tensor_bits(base[k])).all() for k in base)
    round_trip(base, everything)
    # Unrelated values (not one-ulp steps) round-trip too: zigzag differences wrap modulo 2^bits.
    g = torch.Generator().manual_seed(9)
    round_trip(base, {k: torch.randn(v.shape, generator=g).to(dtype) * 1e4 for k, v in base.items()})


def test_signed_zero_nan_payloads_and_infinities_are_bit_patterns():
    base = {"w": torch.tensor([0.0, -0.0, 1.0, float("nan"), float("inf"), -2.0], dtype=torch.float32)}
    bits = tensor_bits(base["w"]).copy()
    bits[0] = 0x80000000           # 0.0 -> -0.0: equal values, different bits
    bits[1] = 0x00000000           # -0.0 -> 0.0
    bits[3] = 0x7FC00123           # a NaN with another payload
    bits[4] = 0xFF800000           # +inf -> -inf
    bits[5] = 0x7F800001           # -2.0 -> a signalling NaN pattern
    new = {"w": torch.from_numpy(bits.view(np.uint8)).view(torch.float32)}
    rebuilt = apply_delta(base, round_trip(base, new))
    assert tensor_bits(rebuilt["w"]).tolist() == bits.tolist()
    half = {"h": torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)}
    hbits = tensor_bits(half["h"]).copy()
    hbits[:] = [0x8000, 0x7FC1]
    round_trip(half, {"h": torch.from_numpy(hbits.view(np.uint8)).view(torch.bfloat16)})


def test_non_contiguous_and_shaped_tensors():
    base = {"m": (torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) / 7).bfloat16()}
    new = {"m": base["m"].clone()}
    new["m"][1, 2, 3] += 1.0
    new["m"][2, 3, 4] = -new["m"][2, 3, 4]
    transposed = {"m": base["m"].transpose(0, 2)}
    rebuilt = apply_delta(transposed, encode_delta(transposed, {"m": new["m"].transpose(0, 2)}))
    assert rebuilt["m"].shape == (5, 4, 3) and rebuilt["m"].is_contiguous()
    assert torch.equal(rebuilt["m"], new["m"].transpose(0, 2))


def test_mixed_item_sizes_share_planes():
    base = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.float32),
            "c": torch.zeros(10, dtype=torch.float64), "d": torch.zeros(3, dtype=torch.uint8)}
    new = {"a": torch.full((10,), 2.0, dtype=torch.bfloat16), "b": torch.full((10,), -1.5),
           "c": torch.full((10,), 1e300, dtype=torch.float64), "d": torch.tensor([1, 0, 255], dtype=torch.uint8)}
    round_trip(base, new)


def test_the_content_follows_the_documented_layout():
    base = {"b": torch.zeros(300, dtype=torch.bfloat16), "a": torch.zeros(2, dtype=torch.bfloat16)}
    new = {"b": base["b"].clone(), "a": base["a"].clone()}
    new["b"][0] = 2.0 ** -133   # bits 0x0001: d = +1, z = zigzag(d) - 1 = 1
    new["b"][200] = -0.0        # bits 0x8000: d = -32768, zigzag 0xFFFF, z = 0xFFFE
    blob = encode_delta(base, new)
    content = zstandard.ZstdDecompressor().decompress(blob)
    # One class (itemsize 2, key 0): a's 2 items, then b's 300; b[0] and b[200] are ranks 2 and 202.
    # 2 of 302 changed: gaps of the changed; z up to 0xFFFE: 16-bit fields (a quarter or fewer escaping
    # at no narrower width), as two byte planes.
    expected = (b"E2SD" + struct.pack("<HI", 2, 2)
                + struct.pack("<H", 1) + b"a" + struct.pack("<BQ", 2, 2)
                + struct.pack("<H", 1) + b"b" + struct.pack("<BQ", 2, 300)
                + struct.pack("<I", 1) + struct.pack("<BBQBBBQ", 2, 0, 302, GAPS_CHANGED, 16, 0, 2)
                + bytes([0x01, 0xFE, 0x00, 0xFF])   # plane 0: low bytes of z 0x0001 and 0xFFFE; plane 1: high
                + bytes([3, 0xC8, 0x01]))           # gaps 3 (from -1 to rank 2) and 200 (2 -> 202) as LEB128
    assert content == expected
    params = zstandard.get_frame_parameters(blob)
    assert params.content_size == len(expected) and not params.has_checksum
    assert blob == zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(expected)
    assert DELTA_FORMAT == "e2s-delta/2"


def test_changes_are_visited_by_the_base_exponent_then_index():
    # Keys (the 8 bits below the sign: bf16's exponent) of the base: 1.0 -> 127, 2^-10 -> 117.
    base = {"w": torch.tensor([1.0, 2.0 ** -10, 1.0, 2.0 ** -10], dtype=torch.bfloat16)}
    bits = tensor_bits(base["w"]).copy()
    bits[0] += 1        # 1.0 up one ulp: z = 1
    bits[1] -= 1        # 2^-10 down one ulp: z = 0
    new = {"w": torch.from_numpy(bits.view(np.uint8)).view(torch.bfloat16)}
    content = content_of(round_trip(base, new))
    # Classes (2, 117): items 1, 3; (2, 127): items 0, 2. Each has its first item changed (half: a
    # bitmap) and one-bit values.
    expected = (b"E2SD" + struct.pack("<HI", 2, 1) + struct.pack("<H", 1) + b"w" + struct.pack("<BQ", 2, 4)
                + struct.pack("<I", 2) + struct.pack("<BBQBBBQ", 2, 117, 2, BITMAP, 1, 0, 1)
                + struct.pack("<BBQBBBQ", 2, 127, 2, BITMAP, 1, 0, 1)
                + bytes([0b0101])       # bitmap: class 117's bits 1, 0 then class 127's 1, 0, low bit first
                + bytes([0, 1]))        # values: class 117's z = 0 (its own byte), class 127's z = 1
    assert content == expected


@pytest.mark.parametrize(("fraction", "mode"), [(0.02, GAPS_CHANGED), (0.5, BITMAP), (0.97, GAPS_UNCHANGED)])
def test_position_modes_follow_the_changed_fraction(fraction, mode):
    base = {"w": torch.ones(5000, dtype=torch.bfloat16)}    # one class: key 127
    new = {"w": nudged(base["w"], fraction, seed=2)}
    content = content_of(round_trip(base, new))
    head = len(b"E2SD") + 6 + (2 + 1 + 9) + 4 + (1 + 1 + 8)   # header, the tensor, n_classes, the class
    assert content[head] == mode and content[head + 1] == 1    # one-ulp steps: one-bit values


def test_escapes_and_overflow_decode_as_documented():
    base = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    z = [0, 1, 0, 1, 0, 1, 0, 300]
    # All 8 changed (no gaps of unchanged); width 1 with escapes: a field of 1 is 1 + its overflow.
    content = (b"E2SD" + struct.pack("<HI", 2, 1) + struct.pack("<H", 1) + b"w" + struct.pack("<BQ", 2, 8)
               + struct.pack("<I", 1) + struct.pack("<BBQBBBQ", 2, 0, 8, GAPS_UNCHANGED, 1, 1, 8)
               + bytes([0b10101010])                # fields min(z, 1), low bit first
               + bytes([0, 0, 0, 299 & 0xFF, 0, 0, 0, 299 >> 8]))  # overflows z - 1 of the 4 escapes, 2 planes
    rebuilt = apply_delta(base, frame(content))
    d = [u // 2 if u % 2 == 0 else -(u + 1) // 2 for u in (v + 1 for v in z)]  # unzigzag(z + 1): -1, +1, ..
    assert tensor_bits(rebuilt["w"]).tolist() == [x % 65536 for x in d]
    wide = {"w": torch.from_numpy(tensor_bits(rebuilt["w"]).copy().view(np.uint8)).view(torch.bfloat16)}
    round_trip(base, wide)


def test_runs_of_the_visiting_order_across_a_large_tensor():
    g = torch.Generator().manual_seed(4)
    base = {"big": (torch.randn(RUN_ITEMS * 2 + 999, generator=g) * 0.02).bfloat16(),
            "bytes": torch.randint(0, 256, (RUN_ITEMS + 5,), generator=g, dtype=torch.uint8)}
    new = {k: nudged(v, 0.01, seed=8) for k, v in base.items()}
    new["big"][RUN_ITEMS - 1] = 5.0     # the last item of the first run, and the first of the next
    new["big"][RUN_ITEMS] = -5.0
    new["big"][-1] = 7.0
    blob = round_trip(base, new)
    # The same rebuild in place, with the base's visiting orders computed ahead (what a follower does).
    bits = {k: tensor_bits(v).copy() for k, v in base.items()}
    orders = visit_orders(bits)
    assert set(orders) == {"big"} and orders["big"].order.dtype == np.uint32 and orders["big"].counts.shape == (3, 256)
    assert sorted(apply_delta_bits(bits, blob, orders)) == ["big", "bytes"]
    assert all(np.array_equal(bits[k], tensor_bits(new[k])) for k in new)


def same_orders(a: dict[str, TensorOrder], b: dict[str, TensorOrder]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k].order, b[k].order) and np.array_equal(a[k].counts, b[k].counts)
                                    for k in a)


def test_advanced_orders_are_the_rebuilt_versions_over_a_chain_of_deltas():
    """A follower advances the held orders after each rebuild instead of sorting again: the rebuild
    reports exactly the items whose key changed, and after every delta of a chain (values crossing
    powers of two, so items change class, in several runs) the advanced orders equal a fresh sort of
    the rebuilt bits, and the rebuilt bits are the learner's."""
    g = torch.Generator().manual_seed(11)
    versions = [{"big": (torch.randn(RUN_ITEMS * 2 + 77, generator=g) * 0.02).bfloat16(),
                 "small": torch.randn(33, 7, generator=g).float(),
                 "bytes": torch.randint(0, 256, (100,), generator=g, dtype=torch.uint8)}]
    for step in range(4):
        new = {k: nudged(v, 0.05, seed=20 + step) for k, v in versions[-1].items()}
        big = new["big"]
        big[torch.randint(0, big.numel(), (300,), generator=g)] *= 2.5  # exponents move: items change class
        big[RUN_ITEMS - 1], big[RUN_ITEMS], big[-1] = -big[RUN_ITEMS - 1] * 4, big[RUN_ITEMS] / 8, 3.0
        new["small"][0] *= 16
        versions.append(new)
    bits = {k: tensor_bits(v).copy() for k, v in versions[0].items()}
    held = visit_orders(bits)
    for base, new in zip(versions, versions[1:]):
        moved_count = sum(int((run_keys_of(tensor_bits(base[k])) != run_keys_of(tensor_bits(new[k]))).sum())
                          for k in ("big", "small"))
        assert moved_count > 300
        moved: dict = {}
        apply_delta_bits(bits, encode_delta(base, new), held, moved)
        assert all(np.array_equal(bits[k], tensor_bits(new[k])) for k in new)
        assert set(moved) == {"big", "small"} and sum(o.size for items in moved.values() for _, o, _, _ in items) == moved_count
        assert all(advance(held[name], items) for name, items in moved.items())
        assert same_orders(held, visit_orders(bits))


def run_keys_of(bits: np.ndarray) -> np.ndarray:
    return (bits >> bits.dtype.type(8 * bits.dtype.itemsize - 9)).astype(np.uint8)


def test_advance_by_hand():
    # one run of 6 items with keys [3, 1, 3, 2, 1, 3]: by key, ties by offset: 1@1 1@4 | 2@3 | 3@0 3@2 3@5
    counts = np.zeros((1, 256), np.int64)
    counts[0, [1, 2, 3]] = [2, 1, 3]
    entry = TensorOrder(np.array([1, 4, 3, 0, 2, 5], np.uint32), counts)
    # item 2 goes from key 3 to 1, item 4 from key 1 to 2
    assert advance(entry, [(0, np.array([2, 4], np.uint32), np.array([3, 1], np.uint8), np.array([1, 2], np.uint8))])
    # keys now [3, 1, 1, 2, 2, 3]: 1@1 1@2 | 2@3 2@4 | 3@0 3@5
    assert entry.order.tolist() == [1, 2, 3, 4, 0, 5] and entry.counts[0, [1, 2, 3]].tolist() == [2, 2, 2]
    # an order that does not hold the item where its old key says: refused
    assert not advance(entry, [(0, np.array([0], np.uint32), np.array([1], np.uint8), np.array([2], np.uint8))])


def test_wrong_orders_cannot_be_advanced():
    """Orders that are not of the bits (a bug) cannot be advanced (the rebuilt bits are wrong too,
    which the caller's hash check refuses: policy/catchup.rebuild then rebuilds without orders)."""
    g = torch.Generator().manual_seed(5)
    base = {"w": (torch.randn(5000, generator=g) * 0.02).bfloat16()}
    new = {"w": base["w"] * 2.5}  # every item changes, most change class
    bits = {"w": tensor_bits(base["w"]).copy()}
    held = visit_orders(bits)
    held["w"].order[:] = held["w"].order[::-1].copy()
    moved: dict = {}
    apply_delta_bits(bits, encode_delta(base, new), held, moved)
    assert not np.array_equal(bits["w"], tensor_bits(new["w"]))
    assert not advance(held["w"], moved["w"])
def test_varints_vectorised_match_leb128():
    values = np.array([1, 2, 127, 128, 255, 16383, 16384, 2**35 + 17, 2**63 - 1], dtype=np.uint64)
    encoded = encode_varints(values)
    reference = bytearray()
    for v in values.tolist():
        while v >= 0x80:
            reference.append((v & 0x7F) | 0x80)
            v >>= 7
        reference.append(v)
    assert encoded.tobytes() == bytes(reference)
    decoded, used = decode_varints(np.frombuffer(bytes(reference) + b"\x05\x06", np.uint8), len(values))
    assert decoded.tolist() == values.tolist() and used == len(reference)
    assert encode_varints(np.zeros(0, np.uint64)).size == 0


def test_encode_refuses_mismatched_tensors():
    base = model_like(torch.bfloat16)
    with pytest.raises(ValueError, match="names differ"):
        encode_delta(base, {k: v for k, v in base.items() if k != "scalar"})
    with pytest.raises(ValueError, match="scalar"):
        encode_delta(base, {**base, "scalar": base["scalar"].float()})
    with pytest.raises(ValueError, match="empty"):
        encode_delta(base, {**base, "empty": torch.zeros(7, 0, dtype=torch.bfloat16)})


# --------------------------------------------------------------------------- hostile blobs

def content_of(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(blob)


def frame(content: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(content)


def refused(base: dict[str, torch.Tensor], blob: bytes, reason: str, match: str | None = None) -> None:
    with pytest.raises(DeltaError, match=match) as caught:
        apply_delta(base, blob)
    assert caught.value.reason == reason, (caught.value.reason, str(caught.value))


@pytest.fixture
def pair():
    base = {"a.weight": (torch.randn(40, 30) * 0.02).bfloat16(), "b.weight": (torch.randn(25) * 0.02).bfloat16()}
    new = {k: nudged(v, 0.1, seed=i) for i, (k, v) in enumerate(base.items())}
    return base, new, encode_delta(base, new)


def test_truncated_and_garbage_blobs(pair):
    base, _, blob = pair
    for cut in (0, 3, 10, len(blob) // 2, len(blob) - 1):
        refused(base, blob[:cut], "malformed")
    refused(base, b"\x00" * 64, "malformed")
    refused(base, bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "malformed")
    refused(base, blob + b"x", "malformed", "beyond")
    refused(base, blob + blob, "malformed", "beyond")
    content = content_of(blob)
    for cut in (4, 9, 12, 40, len(content) - 1):
        refused(base, frame(content[:cut]), "malformed")
    refused(base, frame(content + b"\x00"), "malformed", "beyond the delta's last section")


def test_frame_without_content_size_is_refused(pair):
    base, _, blob = pair
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(content_of(blob))
    refused(base, unsized, "malformed", "content size")


def test_wrong_magic_and_format(pair):
    base, _, blob = pair
    content = content_of(blob)
    refused(base, frame(b"E2SX" + content[4:]), "malformed", "not an e2s-delta")
    refused(base, frame(content[:4] + struct.pack("<H", 3) + content[6:]), "format", "format 3")
    # e2s-delta/1 (the first format: per-tensor change counts, one gap stream, zigzag planes) is not read.
    refused(base, frame(content[:4] + struct.pack("<H", 1) + content[6:]), "format", "format 1")


def table_entry(name: str, itemsize: int, numel: int) -> bytes:
    return struct.pack("<H", len(name.encode())) + name.encode() + struct.pack("<BQ", itemsize, numel)


def unchanged_classes(base: dict[str, torch.Tensor]) -> bytes:
    """The class table of a delta that changes nothing: one entry per (itemsize, key) of the base."""
    items: dict[tuple[int, int], int] = {}
    for t in base.values():
        bits = tensor_bits(t)
        keys = np.zeros(bits.size, np.uint8) if t.element_size() == 1 else (bits >> (8 * t.element_size() - 9))
        for k, n in zip(*np.unique(keys.astype(np.uint8), return_counts=True)):
            items[t.element_size(), int(k)] = items.get((t.element_size(), int(k)), 0) + int(n)
    return struct.pack("<I", len(items)) + b"".join(
        struct.pack("<BBQBBBQ", size, key, n, GAPS_CHANGED, 1, 0, 0) for (size, key), n in sorted(items.items()))


def test_table_that_does_not_fit_the_base(pair):
    base, _, _ = pair
    head = b"E2SD" + struct.pack("<HI", 2, 2)
    good_a, good_b = table_entry("a.weight", 2, 1200), table_entry("b.weight", 2, 25)
    none = unchanged_classes(base)
    assert apply_delta(base, frame(head + good_a + good_b + none))["a.weight"].equal(base["a.weight"])
    refused(base, frame(head + good_a + good_b + none[:-1]), "malformed", "class table is truncated")
    # Classes that are not the base's: a delta made against another base.
    (n_classes,) = struct.unpack_from("<I", none)
    refused(base, frame(head + good_a + good_b + struct.pack("<I", n_classes + 1) + none[4:]), "wrong_base",
            f"{n_classes + 1} classes")
    first = bytearray(none)
    first[6] ^= 1   # the first class's items
    refused(base, frame(head + good_a + good_b + bytes(first)), "wrong_base", "items here")
    first = bytearray(none)
    first[5] ^= 1   # the first class's key
    refused(base, frame(head + good_a + good_b + bytes(first)), "wrong_base", "items here")
    refused(base, frame(head + good_a + good_b + none + b"\x00"), "malformed", "beyond")
    refused(base, frame(b"E2SD" + struct.pack("<HI", 2, 3) + good_a + good_b), "wrong_base", "3 tensors")
    refused(base, frame(head + good_a + table_entry("c.weight", 2, 25)), "wrong_base", "lacks")
    refused(base, frame(head + good_a + good_a), "malformed", "repeated")
    refused(base, frame(head + good_b + good_a), "malformed", "out of name order")
    refused(base, frame(head + table_entry("a.weight", 4, 1200) + good_b), "wrong_base", "items of 4 bytes")
    refused(base, frame(head + table_entry("a.weight", 2, 1201) + good_b), "wrong_base", "1201 items")
    refused(base, frame(head + b"\x05\x00\xff\xfe\xfd\xfc\xfb" + good_b), "malformed")
    empty = frame(b"E2SD" + struct.pack("<HI", 2, 0))
    refused(base, empty, "wrong_base")


def zeros_delta(entry: bytes, *sections: bytes, numel: int = 25) -> bytes:
    """A delta against `{"w": numel bf16 zeros}` (one class: itemsize 2, key 0) with this class entry."""
    return frame(b"E2SD" + struct.pack("<HI", 2, 1) + table_entry("w", 2, numel) + entry + b"".join(sections))


def class_entry(mode: int, width: int, escapes: int, n: int, items: int = 25) -> bytes:
    """The class table of `zeros_delta`: its one class (itemsize 2, key 0) with this entry."""
    return struct.pack("<I", 1) + struct.pack("<BBQBBBQ", 2, 0, items, mode, width, escapes, n)


def test_positions_out_of_range_or_not_increasing():
    base = {"w": torch.zeros(25, dtype=torch.bfloat16)}

    def gaps(raw: bytes, n: int) -> bytes:
        return zeros_delta(class_entry(GAPS_CHANGED, 1, 0, n), bytes(-(-n // 8)), raw)

    rebuilt = apply_delta(base, gaps(b"\x01\x18", 2))["w"]                          # ranks 0 and 24
    assert np.flatnonzero(tensor_bits(rebuilt)).tolist() == [0, 24]
    refused(base, gaps(b"\x01\x19", 2), "malformed", "out of range")             # rank 25 of 25
    refused(base, gaps(b"\x01\x00", 2), "malformed", "out of order")             # repeated rank
    refused(base, gaps(b"\x00", 1), "malformed", "out of order")                  # gap 0 from -1
    # A gap beyond the class's size needs continuation bytes that 25 items leave no room for.
    refused(base, gaps(b"\x81\x00", 1), "malformed", "within the 1 bytes")         # non-minimal varint
    refused(base, gaps(b"\xff" * 9 + b"\x01", 1), "malformed", "within the 1 bytes")
    refused(base, gaps(b"\xff\xff\xff\xff\xff\xff\xff\xff\x7f\x01", 2), "malformed", "within the 2 bytes")
    # Gaps of the unchanged: 23 changed of 25, the unchanged at ranks 3 and 4.
    unchanged = zeros_delta(class_entry(GAPS_UNCHANGED, 1, 0, 23), bytes(3), b"\x04\x01")
    assert np.flatnonzero(tensor_bits(apply_delta(base, unchanged)["w"]) == 0).tolist() == [3, 4]
    refused(base, zeros_delta(class_entry(GAPS_UNCHANGED, 1, 0, 23), bytes(3), b"\x04"),
            "malformed", "ends after 1 of 2")


def test_class_entries_and_sections_that_do_not_fit():
    base = {"w": torch.zeros(25, dtype=torch.bfloat16)}

    entry = class_entry
    bitmap_0_24 = bytes([1, 0, 0, 1])   # bits 0 and 24 of 25, low bit first
    assert apply_delta(base, zeros_delta(entry(BITMAP, 1, 0, 2), bitmap_0_24, b"\x02"))["w"].count_nonzero() == 2
    refused(base, zeros_delta(entry(3, 1, 0, 0)), "malformed", "mode 3")
    refused(base, zeros_delta(entry(GAPS_CHANGED, 3, 0, 0)), "malformed", "width 3")
    refused(base, zeros_delta(entry(GAPS_CHANGED, 32, 0, 0)), "malformed", "width 32")     # wider than bf16
    refused(base, zeros_delta(entry(GAPS_CHANGED, 1, 2, 0)), "malformed", "escapes 2")
    refused(base, zeros_delta(entry(GAPS_CHANGED, 16, 1, 0)), "malformed", "escapes 1")    # at full width
    refused(base, zeros_delta(entry(GAPS_CHANGED, 1, 0, 26)), "malformed", "26 changes in 25 items")
    refused(base, zeros_delta(entry(BITMAP, 1, 0, 3), bitmap_0_24, b"\x02"), "malformed", "holds 2 changes")
    refused(base, zeros_delta(entry(BITMAP, 1, 0, 2), bytes([1, 0, 0, 3]), b"\x02"), "malformed", "padding")
    refused(base, zeros_delta(entry(BITMAP, 1, 0, 2), bitmap_0_24, b"\x06"), "malformed", "padding")  # fields
    refused(base, zeros_delta(entry(BITMAP, 1, 0, 2), bitmap_0_24), "malformed", "ends inside its values")
    refused(base, zeros_delta(entry(BITMAP, 1, 0, 2), bitmap_0_24[:3]), "malformed", "ends inside its bitmap")
    # Full-width values: z = 0xFFFF would change nothing; 0xFFFE (d = -32768) is the largest.
    assert apply_delta(base, zeros_delta(entry(GAPS_CHANGED, 16, 0, 1), b"\xfe\xff", b"\x01"))["w"][0].item() == 0
    refused(base, zeros_delta(entry(GAPS_CHANGED, 16, 0, 1), b"\xff\xff", b"\x01"), "malformed", "changes nothing")
    # Escapes: width 8, a field of 255 takes an overflow; 255 + 0xFF00 would pass the item's bits.
    escaped = entry(GAPS_CHANGED, 8, 1, 1)
    assert apply_delta(base, zeros_delta(escaped, b"\xff", b"\x01", b"\xff\xfe"))["w"][0].item() == 0
    refused(base, zeros_delta(escaped, b"\xff", b"\x01", b"\x00\xff"), "malformed", "past the item's bits")
    refused(base, zeros_delta(escaped, b"\xff", b"\x01", b"\x00"), "malformed", "ends inside its overflow")


def test_varint_decoder_refuses_overlong_and_non_minimal_varints():
    stream = np.frombuffer(b"\x81\x00\x05", np.uint8)
    with pytest.raises(DeltaError, match="shortest form"):
        decode_varints(stream, 2)
    with pytest.raises(DeltaError, match="longer than 9"):
        decode_varints(np.frombuffer(b"\xff" * 9 + b"\x01\x01", np.uint8), 2)
    with pytest.raises(DeltaError, match="ends after 1 of 2"):
        decode_varints(np.frombuffer(b"\x05\x85\x85\x85", np.uint8), 2, max_bytes=3)
    assert decode_varints(np.frombuffer(b"\x05\x85\x01", np.uint8), 2, max_bytes=3)[0].tolist() == [5, 133]


def test_a_zstd_bomb_is_refused_before_it_is_decompressed(pair):
    base, _, _ = pair
    bound = max_delta_bytes(base)
    big = 1 << 30  # 1 GiB of zeros compresses to ~32 KiB
    compressor = zstandard.ZstdCompressor(level=1)
    chunks = compressor.compressobj(size=big)
    zeros = bytes(1 << 20)
    bomb = b"".join(chunks.compress(zeros) for _ in range(big >> 20)) + chunks.flush()
    assert zstandard.get_frame_parameters(bomb).content_size == big > bound
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(base, bomb, "too_large", f"at most {bound}")
    # The same bomb without a declared size is refused too, before decompression.
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    refused(base, b"".join(unsized.compress(zeros) for _ in range(64)) + unsized.flush(), "malformed", "content size")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 200 * 1024, f"refusing the bomb grew the peak RSS by {grown_kib} KiB"


def with_declared_size(blob: bytes, size: int) -> bytes:
    """`blob` (one zstd frame, single segment, no dictionary) with its Frame_Content_Size field rewritten."""
    descriptor = blob[4]
    assert descriptor & 0x20 and not descriptor & 0x03, "expected a single-segment frame without a dictionary"
    width = {0: 1, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    stored = size - 256 if width == 2 else size
    return blob[:5] + stored.to_bytes(width, "little") + blob[5 + width:]


def test_a_frame_lying_about_its_content_size_is_refused(pair):
    base, _, blob = pair
    content = content_of(blob)
    longer = frame(content + bytes(100))
    assert with_declared_size(longer, len(content) + 100) == longer
    refused(base, with_declared_size(longer, len(content)), "malformed")        # holds more than declared
    refused(base, with_declared_size(longer, len(content) + 150), "malformed")  # holds less


def test_max_delta_bytes_bounds_every_honest_delta():
    base = model_like(torch.float32)
    everything = {k: nudged(v, 1.0, seed=5) for k, v in base.items()}
    content = content_of(encode_delta(base, everything))
    assert len(content) <= max_delta_bytes(base)
    expected_floor = sum(t.numel() * t.element_size() for t in base.values())
    assert expected_floor < max_delta_bytes(base) < 3 * expected_floor + 1000
    assert math.isfinite(max_delta_bytes({}))


def test_bitmaps_unpacked_in_pieces_across_unaligned_classes(monkeypatch):
    # Several bitmap classes of odd sizes (their bits start mid-byte), unpacked 24 bits at a time.
    monkeypatch.setattr(delta, "_BITS_AT_ONCE", 24)
    g = torch.Generator().manual_seed(11)
    scales = torch.tensor([1.0, 2.0, 4.0, 8.0]).repeat_interleave(torch.tensor([101, 257, 59, 333]))
    base = {"w": (scales * (1 + torch.rand(750, generator=g) * 0.5)).bfloat16()}
    new = {"w": nudged(base["w"], 0.5, seed=12)}
    content = content_of(round_trip(base, new))
    assert content.count(struct.pack("<BB", BITMAP, 1)) >= 3
